"""Admission and preemption: which waiting requests join the batch between steps, and who makes
room for them.

Owners (API keys) are taken in turn, each owner's requests in order (`FairQueue`). A request
joins when the batch has a slot for each of its choices and the KV budget room for its prompt
(`KVBudget.need`); cached blocks are evicted for it, least recently used first, then sessions'
pins. An owner with nothing running gets a slot of a full batch at once (`_slot_claim`: the
newest sequence of an owner holding two or more is preempted for it), and KV memory the same
way (`_memory_claim`: the newest sequences of whoever holds the most, never an owner's last).

A heavy key (or one a new prompt makes heavy) that already has a sequence running may not take
sessions' pins: its next prompt waits for room (`_spares_pins`) while other owners' requests
behind it in turn are admitted, so one key's long prompts cannot evict the KV that lets another
key's next turn skip its history. A waiting request that needs a slot or KV a warm-up holds
drops it first, before any preemption or unpinning.

At admission (`_start`) a sequence reuses the longest prefix the prefix cache holds, then what
its session spilled to the store, and allocates its buffer; a preempted sequence (or a choice
parked at its fork) keeps its first admission order, so the oldest running sequence is never
the one preempted. The session's own request takes over what its warm-up computed so far.

A preempted sequence (`_preempt`, for fair share or when decoding outgrows the KV budget) gives
its computed blocks to the prefix cache, frees its buffer and goes back to the front of its
owner's line. A request for n choices is admitted once, and at the end of its prompt forked
(`_fork`): the siblings join the batch while it has free slots, each with a copy of the
prompt's KV, and the rest wait at the front of the queue like preempted sequences.

`Admission` is a part of `Scheduler` (gateway.engine.local.scheduler), written apart for
reading: it runs on the engine thread and uses the scheduler's queue, batch, prefix cache and
KV budget, which it declares below.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING

import structlog

from gateway.engine.interface import EngineError
from gateway.engine.local.batch import SeqKV
from gateway.engine.local.choices import copy_kv, fork, post_results
from gateway.engine.local.fair_queue import newest_of_largest
from gateway.engine.local.kv.blocks import block_hashes, position_keys
from gateway.engine.local.sequence import GROW, load_spilled, prepare_sequence
from gateway.engine.local.step_plan import HEAVY_DEMAND_STEPS

if TYPE_CHECKING:
    from gateway.engine.local.choices import StepLogprobs
    from gateway.engine.local.fair_queue import FairQueue
    from gateway.engine.local.grammar import TokenVocab
    from gateway.engine.local.kv.budget import KVBudget
    from gateway.engine.local.kv.prefix_cache import PrefixCache, PrefixMatch
    from gateway.engine.local.kv.store import KVStore
    from gateway.engine.local.sequence import SchedulerConfig, Sequence
    from gateway.engine.local.step_plan import StepPlanner
    from gateway.engine.local.weights import LoadedModel

__all__ = ("Admission",)

log = structlog.get_logger(__name__)

_owner = attrgetter("owner")
_order = attrgetter("order")


class Admission:
    """The scheduler's admission (see the module doc); mixed into `Scheduler`."""

    # the scheduler's, shared with its other parts
    w: LoadedModel
    cfg: SchedulerConfig
    max_positions: int
    vocab: TokenVocab
    cache: PrefixCache
    budget: KVBudget
    kv_store: KVStore | None
    base_seed: bytes
    num_layers: int
    kv_heads: int
    head_dim: int
    _cond: threading.Condition
    _waiting: FairQueue[Sequence]
    _running: list[Sequence]
    _warming: list[Sequence]
    _warmed: dict[str, tuple[int, int]]
    _planner: StepPlanner
    _order: int
    _slots: Callable[[], int]
    _preemptions: int
    _fail: Callable[[Sequence, EngineError], None]
    _publish: Callable[..., None]
    _logprobs: StepLogprobs | None
    _drop_warmups: Callable[[str], bool]
    _take_over_warmups: Callable[[str], None]

    def _admit(self) -> None:
        with self._cond:  # a cancelled request leaves the queue at once, not when it is its turn
            cancelled = [s for s in self._waiting if s.request.cancel.is_set()]
            for seq in cancelled:
                self._waiting.discard(seq)
        self._admit_requests(cancelled)
        self._admit_warmups()

    def _admit_requests(self, cancelled: list[Sequence]) -> None:
        now = time.perf_counter()
        for seq in cancelled:
            post_results(seq, "cancelled", now)
        parked: set[int] = set()  # heavy keys' heads that wait this pass (`_spares_pins`)
        while True:
            if self._warming and self._waiting and self._slots() >= self.cfg.max_batch:
                self._drop_warmups("slots")  # a waiting request goes before any warm-up
            with self._cond:
                slots = self._slots()
                if slots < self.cfg.max_batch:
                    seq = next((h for h in self._waiting.heads() if id(h) not in parked), None)
                    victim = None
                else:
                    seq, victim = self._slot_claim()
            if seq is None:
                return
            if victim is None and self._running and slots + seq.width > self.cfg.max_batch:
                if self._drop_warmups("slots"):
                    continue
                return  # a request of n choices waits for n free slots
            req = seq.request
            if req.cancel.is_set():
                self._dequeue(seq, served=False)
                post_results(seq, "cancelled", time.perf_counter())
                continue
            try:
                if seq.prompt is None:
                    self._prepare(seq)
            except EngineError as exc:
                self._dequeue(seq)
                seq.job.post(exc)
                continue
            except Exception as exc:
                log.exception("engine.prepare_failed", request_id=req.request_id)
                self._dequeue(seq)
                seq.job.post(EngineError(f"generation failed: {exc}"))
                continue
            need = self.budget.need(seq)
            if self._warming and need > self.budget.room_beside_pins():
                self._drop_warmups("kv_pressure")  # before any pin or preemption
            if victim is None and self._spares_pins(seq, need):
                parked.add(id(seq))  # the next owner in turn may still fit
                continue
            staying = [s for s in self._running if s is not victim]
            room = self.budget.room_beside(staying)
            if staying and room < need:
                # no KV room for the next in turn: an owner with nothing running may still
                # claim memory from the owner holding the most; otherwise wait for one to end
                claim = self._memory_claim()
                if claim is None:
                    return
                seq, victims = claim
                for v in victims:
                    self._preempt(v, "fair_share")
                need = self.budget.need(seq)
                staying = list(self._running)
                room = self.budget.room_beside(staying)
                victim = None
            if victim is not None:
                self._preempt(victim, "fair_share")
            if staying:  # what the staying sequences leave: the cache gives way, pins too
                self.budget.evict_to(room - need, unpin=True)
            self._dequeue(seq)
            try:
                self._start(seq)
            except Exception as exc:  # out of the queue, not yet running: fail it here
                log.exception("engine.admit_failed", request_id=req.request_id)
                self._fail(seq, EngineError(f"generation failed: {exc}"))

    def _spares_pins(self, seq: Sequence, need: int) -> bool:
        """Whether `seq` waits rather than take sessions' pinned KV: a heavy key that has a
        sequence running is admitted only into the room that running sequences and pinned
        blocks leave, so its long prompts cannot evict the KV that lets another key's next
        turn skip its history. Heavy: counted so by `StepPlanner.heavy_keys`, or made so by
        this prompt (a burst is admitted before any step classifies it): what its running
        prompts and this one still have to prefill, net of cached prefixes, is over
        `HEAVY_DEMAND_STEPS` steps' budget. With nothing running a key may take pins (it must
        make progress); a light key always may."""
        if need <= self.budget.room_beside_pins():
            return False
        mine = [s for s in self._running if s.owner == seq.owner]
        if not mine:
            return False
        if seq.owner in self._planner.heavy:
            return True
        demand = self._uncached(seq) + sum(s.known - s.fed for s in mine)
        return demand > HEAVY_DEMAND_STEPS * self.cfg.prefill_chunk_tokens

    def _uncached(self, seq: Sequence) -> int:
        """Positions of `seq` the prefix cache does not hold (what it would prefill)."""
        return seq.known - self._lookup(seq, use=False)[1].length

    def _lookup(self, seq: Sequence, *, use: bool = True) -> tuple[list[int], PrefixMatch]:
        """`seq`'s positions and the longest cached prefix of them (at least one position is
        left to feed: its logits give the next token); `use` counts the match as a cache hit."""
        assert seq.prompt is not None
        tokens = [*seq.prompt.tokens, *seq.generated]
        keys = position_keys(tokens, seq.prompt.images)
        hashes = block_hashes(tokens, seq.prompt.images, self.cfg.block_size, seq.seed)
        return tokens, self.cache.match(seq.seed, keys, hashes, seq.known - 1, count=use)

    def _slot_claim(self) -> tuple[Sequence | None, Sequence | None]:
        """With the batch full: the first waiting request, in turn order, of an owner with
        nothing running, and whom to preempt for it (the newest sequence of the owner holding
        the most, if that is two or more). (None, None): it waits for a slot to free."""
        victim = newest_of_largest(self._running, _owner, _order)
        if victim is None or sum(s.owner == victim.owner for s in self._running) < 2:
            return None, None
        busy = {s.owner for s in self._running}
        for head in self._waiting.heads():
            if head.owner not in busy:
                return head, victim
        return None, None

    def _memory_claim(self) -> tuple[Sequence, list[Sequence]] | None:
        """With too little KV memory for the next in turn: the first waiting request, in turn
        order, of an owner with nothing running, and the sequences to preempt so that it fits
        (the newest of whichever owner holds the most, never an owner's last one). None: it
        waits for memory like everyone else."""
        busy = {s.owner for s in self._running}
        with self._cond:
            head = next((h for h in self._waiting.heads() if h.owner not in busy), None)
        if head is None:
            return None
        if head.prompt is None:
            try:
                self._prepare(head)
            except Exception:
                return None  # refused when its turn comes, by the usual path
        need = self.budget.need(head)
        staying = list(self._running)
        room = self.budget.room_beside(staying)
        victims: list[Sequence] = []
        while room < need:
            victim = newest_of_largest(staying, _owner, _order)
            if victim is None or sum(s.owner == victim.owner for s in staying) < 2:
                return None
            staying.remove(victim)
            victims.append(victim)
            room += self.budget.held_by([victim])
        return head, victims

    def _heavy_victim(self) -> Sequence | None:
        """The newest sequence of a heavy key running two or more, if any."""
        counts: dict[str | None, int] = {}
        for s in self._running:
            counts[s.owner] = counts.get(s.owner, 0) + 1
        keys = self._planner.heavy
        heavy = [s for s in self._running if s.owner in keys and counts[s.owner] >= 2]
        return max(heavy, key=_order) if heavy else None

    def _preempt(self, seq: Sequence, reason: str) -> None:
        self._running.remove(seq)
        self._publish(seq, make_room=False)  # the caller frees what it needs, its own way
        seq.kv, seq.fed = None, 0
        seq.held = 0
        seq.preemptions += 1
        self._preemptions += 1
        with self._cond:
            self._waiting.push_front(seq)
        log.info(
            "engine.preempted",
            request_id=seq.request.request_id,
            reason=reason,
            positions=seq.known,
            generated=len(seq.generated),
        )

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The other choices of `seq`'s request, at the end of its prompt: each gets a copy of
        the prompt's KV while the batch has free slots; the rest wait at the front of the
        queue like preempted sequences (the prompt's blocks in the prefix cache for them).
        Returns the siblings that joined the batch."""
        assert seq.kv is not None
        siblings = fork(seq, self.w)
        free = self.cfg.max_batch - self._slots()
        joined, parked = [], []
        for sibling in siblings:
            self._order += 1
            sibling.order = self._order
            if free <= 0:
                parked.append(sibling)
                continue
            sibling.kv, sibling.fed = copy_kv(seq.kv, seq.fed, seq.known + GROW), seq.fed
            self._running.append(sibling)
            joined.append(sibling)
            free -= 1
        if self._logprobs is not None:
            self._logprobs.share(seq, joined)
        if parked:
            self._publish(seq)
            with self._cond:
                for sibling in reversed(parked):
                    self._waiting.push_front(sibling)
        return joined

    def _prepare(self, seq: Sequence) -> None:
        prepare_sequence(seq, self.w, self.max_positions, self.cfg.block_size, self.vocab)

    def _dequeue(self, seq: Sequence, *, served: bool = True) -> None:
        """Take `seq` out of the queue; served (admitted or refused), its owner's turn passes."""
        with self._cond:
            if served:
                self._waiting.take(seq)
            else:
                self._waiting.discard(seq)

    def _start(self, seq: Sequence) -> None:
        """Admit: reuse the longest cached prefix, allocate the buffer, join the batch."""
        assert seq.prompt is not None
        first = seq.order == 0  # preempted, or a choice parked at its fork: admitted before
        kv_key = seq.request.kv_key
        if kv_key is not None and not seq.warm:
            self._take_over_warmups(kv_key)
        tokens, found = self._lookup(seq)
        limit = seq.known - 1
        kv = SeqKV(
            self.num_layers,
            self.kv_heads,
            self.head_dim,
            seq.known + GROW,
            self.w.dtype,
            self.w.device,
        )
        at = 0
        for block, n in found.blocks:
            kv.load(block.kv.unbind(0), at, n)
            at += n
        reused = found.length
        if kv_key is not None:
            self.cache.touch_session(kv_key)
            if self.kv_store is not None and reused < limit:
                block = self.cfg.block_size
                loaded = load_spilled(seq, kv, tokens, limit, self.kv_store, block, self.base_seed)
                reused = max(reused, loaded)
        seq.kv, seq.fed = kv, reused
        if first:  # a preempted sequence keeps its admission order (its seniority)
            seq.cached = reused
            seq.admitted = time.perf_counter()
            self._order += 1
            seq.order = self._order
            warmed = self._warmed.pop(kv_key, None) if kv_key and not seq.warm else None
            if warmed is not None:
                seq.warmed = max(min(reused, warmed[1]) - warmed[0], 0)
        (self._warming if seq.warm else self._running).append(seq)
