"""The KV budget on real buffers and a real prefix cache: what it counts, what it leaves room
for, and the order memory comes back in (cached blocks, warm pins, warm-ups, a heavy key's
newest sequence, sessions' pins, the largest owner's newest)."""

from __future__ import annotations

import torch

from gateway.engine.local.batch import SeqKV
from gateway.engine.local.kv.blocks import block_hashes, position_keys
from gateway.engine.local.kv.budget import KVBudget
from gateway.engine.local.kv.prefix_cache import PrefixCache
from gateway.engine.local.sequence import GROW

BLOCK = 4
POS = SeqKV.bytes_per_position(1, 1, 4, torch.float32)  # 32 bytes a position
SEED = b"seed"


def _kv(positions: int) -> SeqKV:
    kv = SeqKV(1, 1, 4, positions, torch.float32, torch.device("cpu"))
    for layer in kv.layers:
        layer.zero_()
    return kv


class _Holder:
    """What the budget reads of a running sequence: its buffer, positions and width."""

    def __init__(self, positions: int, width: int = 1) -> None:
        self.kv: SeqKV | None = _kv(positions)
        self.known, self.width = positions, width


def _cache_turn(cache: PrefixCache, first_token: int, blocks: int) -> list[bytes]:
    tokens = list(range(first_token, first_token + blocks * BLOCK))
    kv = _kv(len(tokens))
    hashes = block_hashes(tokens, [], BLOCK, SEED)
    return cache.insert(SEED, position_keys(tokens, []), hashes, kv.layers, len(tokens))


def _setup(budget_positions: int):
    cache = PrefixCache(BLOCK)
    running: list[_Holder] = []
    warming: list[_Holder] = []
    budget = KVBudget(budget_positions * POS, POS, BLOCK, cache, lambda: (running, warming))
    return budget, cache, running, warming


def test_it_counts_buffers_and_cached_blocks_against_one_budget() -> None:
    budget, cache, running, warming = _setup(100)
    running.append(_Holder(10))
    warming.append(_Holder(6))
    cache.pin("sess", _cache_turn(cache, 0, 2))  # 8 positions, pinned
    _cache_turn(cache, 1000, 1)  # 4 positions, not pinned
    assert budget.buffers() == 16 * POS
    assert budget.used() == 28 * POS
    assert budget.free() == 72 * POS
    assert budget.room_beside_pins() == (100 - 16 - 8) * POS  # unpinned blocks can go
    assert budget.room_beside(running) == 90 * POS  # the warm-up's buffer not counted
    assert budget.need(_Holder(20, width=3)) == (20 + GROW) * 3 * POS
    assert budget.need(_Holder(20, width=3), choices=1) == (20 + GROW) * POS
    used, total, cached = budget.blocks()
    assert (used, total, cached) == (4 + 3, 25, 3)  # 16 buffer positions, 12 cached


def test_making_room_takes_unpinned_blocks_then_warm_pins_never_session_pins() -> None:
    budget, cache, running, _ = _setup(30)
    cache.pin("sess", _cache_turn(cache, 0, 2))  # 8 positions
    cache.pin("warm", _cache_turn(cache, 100, 2), warm=True)  # 8
    _cache_turn(cache, 200, 2)  # 8, unpinned
    running.append(_Holder(10))  # 10 + 24 cached > 30
    assert budget.make_room(unpin=False)
    # unpinned blocks go least recently used first, only as many as the room needs
    assert cache.warm_sessions == 1 and cache.nbytes == 20 * POS
    assert budget.make_room(8 * POS, unpin=False) and cache.warm_sessions == 0  # then warm pins
    assert cache.pinned_sessions == 1  # the session's pin stays without `unpin`
    assert not budget.make_room(20 * POS, unpin=False)
    assert budget.make_room(20 * POS, unpin=True) and cache.pinned_sessions == 0


def test_reclaim_gives_memory_back_in_its_order() -> None:
    budget, cache, running, warming = _setup(20)
    cache.pin("sess", _cache_turn(cache, 0, 2))  # 8 positions, a session's pin
    cache.pin("warm", _cache_turn(cache, 100, 1), warm=True)  # 4, a warm-up's pin
    _cache_turn(cache, 200, 1)  # 4, unpinned
    running.extend([_Holder(12), _Holder(12), _Holder(12)])
    warming.append(_Holder(6))
    calls: list[str] = []

    def drop_warmups() -> bool:
        if not warming:
            return False
        calls.append(f"warmups:{cache.warm_sessions}:{cache.pinned_sessions}")
        warming.clear()
        return True

    heavy = [running[2]]

    def preempt_heavy() -> bool:
        if not heavy:
            return False
        calls.append(f"heavy:{cache.pinned_sessions}")
        running.remove(heavy.pop())
        return True

    def preempt_largest() -> bool:
        if len(running) <= 1:
            return False
        calls.append(f"largest:{cache.pinned_sessions}")
        running.pop()
        return True

    budget.reclaim(drop_warmups, preempt_heavy, preempt_largest)
    # unpinned and warm blocks went before any warm-up's buffer, the warm-ups before the heavy
    # key's newest, and that before the session's pin; only then the largest owner's newest
    assert calls == ["warmups:0:1", "heavy:1", "largest:0"], calls
    assert len(running) == 1 and not warming and cache.nbytes == 0
    assert budget.used() <= budget.budget_bytes


def test_one_sequence_alone_may_exceed_the_budget() -> None:
    budget, cache, running, _ = _setup(8)
    cache.pin("sess", _cache_turn(cache, 0, 1))
    running.append(_Holder(20))
    budget.reclaim(lambda: False, lambda: False, lambda: len(running) > 1)
    assert len(running) == 1 and cache.nbytes == 0  # its pins went, it stays
    seq = running[0]
    budget.grow(seq, 30)
    assert seq.kv is not None and seq.kv.capacity >= 30 + GROW
