"""KV memory on real buffers, a real prefix cache and a real spill store: what the budget counts,
how a sequence's positions are committed with a pin and reopened, and the order memory comes
back in (cached blocks, warm pins, warm-ups, a heavy key's newest sequence, sessions' pins, the
largest owner's newest)."""

from __future__ import annotations

import torch

from gateway.engine.interface import GenerationRequest
from gateway.engine.local.batch import SeqKV
from gateway.engine.local.kv.blocks import chain_seed
from gateway.engine.local.kv.kv_memory import KVLayout, KVMemory
from gateway.engine.local.kv.store import MemoryKVStore
from gateway.engine.local.prompt import Prompt
from gateway.engine.local.sequence import GROW, Job, Sequence

BLOCK = 4
LAYOUT = KVLayout(1, 1, 4, torch.float32, torch.device("cpu"))
POS = LAYOUT.pos_bytes  # 32 bytes a position
SEED = chain_seed("test-model", "float32", BLOCK)
SPILL_SEED = chain_seed("test-model", "float32|spill", BLOCK)


def _kv(positions: int, fill: float = 0.0) -> SeqKV:
    kv = LAYOUT.buffer(positions)
    for layer in kv.layers:
        layer.copy_(torch.arange(layer.numel(), dtype=torch.float32).reshape(layer.shape) + fill)
    return kv


class _Holder:
    """What the budget reads of a running sequence: its buffer, positions and width."""

    def __init__(self, positions: int, width: int = 1) -> None:
        self.kv: SeqKV | None = _kv(positions)
        self.known, self.width = positions, width


def _seq(tokens: list[int], kv_key: str | None = None, *, fed: int | None = None) -> Sequence:
    """A sequence whose buffer holds `fed` (all, by default) of `tokens`' positions."""
    request = GenerationRequest(f"r{tokens[0]}", [], kv_key=kv_key)
    seq = Sequence(Job(request, None, None, 0.0))  # type: ignore[arg-type]  # never posts
    seq.prompt = Prompt([], tokens=list(tokens))
    seq.seed = SEED
    seq.fed = len(tokens) if fed is None else fed
    seq.kv = _kv(len(tokens), fill=float(tokens[0]))
    return seq


def _turn(first_token: int, blocks: int) -> list[int]:
    return list(range(first_token, first_token + blocks * BLOCK))


def _setup(budget_positions: int, store: MemoryKVStore | None = None):
    running: list[_Holder] = []
    warming: list[_Holder] = []
    memory = KVMemory(
        LAYOUT,
        budget_positions * POS,
        BLOCK,
        lambda: (running, warming),
        store=store,
        spill_seed=SPILL_SEED,
    )
    return memory, running, warming


def test_it_counts_buffers_and_cached_blocks_against_one_budget() -> None:
    memory, running, warming = _setup(100)
    running.append(_Holder(10))
    warming.append(_Holder(6))
    assert memory.commit(_seq(_turn(0, 2), "sess"), "turn", unpin=None) == 8  # pinned
    assert memory.commit(_seq(_turn(1000, 1)), "none", unpin=None) == 4  # not pinned
    assert memory.buffers() == 16 * POS
    assert memory.used() == 28 * POS and memory.cached_bytes == 12 * POS
    assert memory.free() == 72 * POS
    assert memory.pinned_bytes == 8 * POS and memory.pinned("sess")
    assert memory.room_beside_pins() == (100 - 16 - 8) * POS  # unpinned blocks can go
    assert memory.room_beside(running) == 90 * POS  # the warm-up's buffer not counted
    assert memory.need(_Holder(20, width=3)) == (20 + GROW) * 3 * POS  # type: ignore[arg-type]
    assert memory.need(_Holder(20, width=3), choices=1) == (20 + GROW) * POS  # type: ignore[arg-type]
    used, total, cached = memory.blocks()
    assert (used, total, cached) == (4 + 3, 25, 3)  # 16 buffer positions, 12 cached


def test_making_room_takes_unpinned_blocks_then_warm_pins_never_session_pins() -> None:
    memory, running, _ = _setup(30)
    memory.commit(_seq(_turn(0, 2), "sess"), "turn", unpin=None)  # 8 positions
    memory.commit(_seq(_turn(100, 2), "warm"), "warm", unpin=None)  # 8
    memory.commit(_seq(_turn(200, 2)), "none", unpin=None)  # 8, unpinned
    running.append(_Holder(10))  # 10 + 24 cached > 30
    assert memory.make_room(unpin=False)
    # unpinned blocks go least recently used first, only as many as the room needs
    assert memory.warm_sessions == 1 and memory.cached_bytes == 20 * POS
    assert memory.make_room(8 * POS, unpin=False) and memory.warm_sessions == 0  # then warm pins
    assert memory.pinned_sessions == 1  # the session's pin stays without `unpin`
    assert not memory.make_room(20 * POS, unpin=False)
    assert memory.make_room(20 * POS, unpin=True) and memory.pinned_sessions == 0


def test_a_commit_evicts_as_its_unpin_allows() -> None:
    memory, running, _ = _setup(20)
    memory.commit(_seq(_turn(0, 2), "sess"), "turn", unpin=None)  # 8 positions, pinned
    running.append(_Holder(8))
    # a warm-up's commit takes the total over the budget: never at the session's pin's cost
    memory.commit(_seq(_turn(100, 2), "other"), "warm", unpin=False)
    assert memory.pinned("sess") and not memory.pinned("other", "warm")
    assert memory.used() <= memory.budget_bytes
    # a request's turn brings the total back under the budget, the other session's pin too
    memory.commit(_seq(_turn(200, 2), "next"), "turn", unpin=True)
    assert memory.pinned("next") and not memory.pinned("sess")
    assert memory.used() <= memory.budget_bytes
    # a preemption's commit evicts nothing: the step's reclaim goes on in its order
    memory.commit(_seq(_turn(300, 2)), "none", unpin=None)
    assert memory.used() > memory.budget_bytes


def test_reclaim_gives_memory_back_in_its_order() -> None:
    memory, running, warming = _setup(20)
    memory.commit(_seq(_turn(0, 2), "sess"), "turn", unpin=None)  # 8 positions, a turn's pin
    memory.commit(_seq(_turn(100, 1), "warm"), "warm", unpin=None)  # 4, a warm-up's pin
    memory.commit(_seq(_turn(200, 1)), "none", unpin=None)  # 4, unpinned
    running.extend([_Holder(12), _Holder(12), _Holder(12)])
    warming.append(_Holder(6))
    calls: list[str] = []

    def drop_warmups() -> bool:
        if not warming:
            return False
        calls.append(f"warmups:{memory.warm_sessions}:{memory.pinned_sessions}")
        warming.clear()
        return True

    heavy = [running[2]]

    def preempt_heavy() -> bool:
        if not heavy:
            return False
        calls.append(f"heavy:{memory.pinned_sessions}")
        running.remove(heavy.pop())
        return True

    def preempt_largest() -> bool:
        if len(running) <= 1:
            return False
        calls.append(f"largest:{memory.pinned_sessions}")
        running.pop()
        return True

    memory.reclaim(drop_warmups, preempt_heavy, preempt_largest)
    # unpinned and warm blocks went before any warm-up's buffer, the warm-ups before the heavy
    # key's newest, and that before the session's pin; only then the largest owner's newest
    assert calls == ["warmups:0:1", "heavy:1", "largest:0"], calls
    assert len(running) == 1 and not warming and memory.cached_bytes == 0
    assert memory.used() <= memory.budget_bytes


def test_one_sequence_alone_may_exceed_the_budget() -> None:
    memory, running, _ = _setup(8)
    memory.commit(_seq(_turn(0, 1), "sess"), "turn", unpin=None)
    running.append(_Holder(20))
    memory.reclaim(lambda: False, lambda: False, lambda: len(running) > 1)
    assert len(running) == 1 and memory.cached_bytes == 0  # its pins went, it stays
    seq = running[0]
    memory.grow(seq, 30)  # type: ignore[arg-type]
    assert seq.kv is not None and seq.kv.capacity >= 30 + GROW


def test_a_committed_prefix_is_reopened_and_forget_drops_it() -> None:
    memory, _, _ = _setup(1000)
    turn = _seq([*_turn(7, 2), 1, 2], "sess")  # two full blocks and a partial one
    assert memory.commit(turn, "turn", unpin=True) == 10
    follow_up = _seq([*_turn(7, 2), 1, 2, 3, 4, 5], "sess", fed=0)
    assert memory.match(follow_up) == 10
    kv, held = memory.open(follow_up)
    assert held == 10 and kv.capacity >= follow_up.known + GROW
    assert torch.equal(kv.layers[0][:, :, :10], turn.kv.layers[0][:, :, :10])  # type: ignore[union-attr]
    assert memory.match(_seq(_turn(7, 1) + [99] * 4)) == 4  # the common prefix only
    memory.forget("sess")
    assert not memory.pinned("sess") and memory.match(follow_up) == 0
    assert memory.cached_bytes == 0


def test_a_turn_is_spilled_and_read_back_once_the_cache_let_it_go() -> None:
    store = MemoryKVStore(1 << 20)
    memory, _, _ = _setup(1000, store)
    turn = _seq(_turn(3, 3), "sess")
    memory.commit(turn, "turn", unpin=True)
    memory.commit(_seq(_turn(50, 3), "other"), "warm", unpin=True)
    assert "sess" in store and "other" not in store  # a turn is spilled, a warm-up is not
    memory.clear()
    follow_up = _seq([*_turn(3, 3), 60, 61], "sess", fed=0)
    assert memory.match(follow_up) == 0  # nothing cached any more
    kv, held = memory.open(follow_up)
    assert held == 12
    assert torch.equal(kv.layers[0][:, :, :12], turn.kv.layers[0][:, :, :12])  # type: ignore[union-attr]
    memory.forget("sess")
    assert "sess" not in store


def test_non_finite_kv_is_never_committed() -> None:
    store = MemoryKVStore(1 << 20)
    memory, _, _ = _setup(1000, store)
    broken = _seq(_turn(0, 2), "sess")
    broken.kv.layers[0][0, 0, 3, 1] = float("nan")  # type: ignore[union-attr]
    assert memory.commit(broken, "turn", unpin=True) == 0
    assert memory.cached_bytes == 0 and not memory.pinned("sess") and "sess" not in store
