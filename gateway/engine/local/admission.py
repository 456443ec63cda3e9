"""Admission and preemption: which waiting requests join the batch between steps, and who makes
room for them.

Owners (API keys) are taken in turn, each owner's requests in order (`FairQueue`). A request
joins when the batch has a slot for each of its choices and the KV budget room for its prompt
(`KVMemory.need`); cached blocks are evicted for it, least recently used first, then sessions'
pins. An owner with nothing running gets a slot of a full batch at once (`_slot_claim`: the
newest sequence of an owner holding two or more is preempted for it), and KV memory the same
way (`_memory_claim`: the newest sequences of whoever holds the most, never an owner's last).

A heavy key (or one a new prompt makes heavy) that already has a sequence running may not take
other owners' sessions' pins (its own sessions' pins go first, least recently used first): its
next prompt waits for room (`_spares_pins`) while other owners' requests behind it in turn are
admitted, so one key's long prompts cannot evict the KV that lets another key's next turn skip
its history. A waiting request that needs a slot or KV a warm-up holds
drops it first, before any preemption or unpinning. Warm-ups are admitted after requests, into
what they leave (`WarmUps.admit`).

At admission (`_start`) a sequence is given a buffer holding the longest prefix KV memory has
of it (`KVMemory.open`); a preempted sequence (or a choice parked at its fork) keeps its first
admission order, so the oldest running sequence is never the one preempted. The session's own
request takes over what its warm-up computed so far.

A preempted sequence (`preempt`, for fair share or when decoding outgrows the KV budget) gives
its computed blocks to the prefix cache, frees its buffer and goes back to the front of its
owner's line. A request for n choices is admitted once, and at the end of its prompt forked
(`fork`): the siblings join the batch while it has free slots, each with a copy of the
prompt's KV, and the rest wait at the front of the queue like preempted sequences.

`Admission` owns the requests' side of the batch: the queue (`queue`) and the running sequences
(`running`). It is given the scheduler's config, the engine's KV memory, the warm-ups (which
yield to requests), the engine loop's lock (the queue is filled from other threads) and three
functions: `prepare` (a request's prompt rendered), `siblings` (a request's other choices) and
`heavy` (the keys the step planner counts as heavy now). It runs on the engine thread,
`enqueue` excepted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from operator import attrgetter
from typing import TYPE_CHECKING

import structlog

from gateway.engine.interface import EngineError
from gateway.engine.local.choices import copy_kv, post_results
from gateway.engine.local.fair_queue import FairQueue, newest_of_largest
from gateway.engine.local.sequence import GROW
from gateway.engine.local.step_plan import HEAVY_DEMAND_STEPS

if TYPE_CHECKING:
    import threading

    from gateway.engine.local.kv.kv_memory import KVMemory
    from gateway.engine.local.kv_warmup import WarmUps
    from gateway.engine.local.sequence import SchedulerConfig, Sequence

__all__ = ("Admission",)

log = structlog.get_logger(__name__)

_owner = attrgetter("owner")
_order = attrgetter("order")


class Admission:
    """The requests' queue and batch, and who moves between them; see the module doc."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVMemory,
        warmups: WarmUps,
        lock: threading.Condition,
        *,
        prepare: Callable[[Sequence], None],
        siblings: Callable[[Sequence], list[Sequence]],
        heavy: Callable[[], Collection[str | None]],
    ) -> None:
        self.cfg = config
        self._kv = kv
        self._warmups = warmups
        self._lock = lock
        self._prepare = prepare
        self._siblings = siblings
        self._heavy = heavy
        self.queue: FairQueue[Sequence] = FairQueue(_owner)
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._order = 0  # admissions so far: a sequence's order is its seniority

    # -- the queue (from any thread) -----------------------------------------------------------

    def enqueue(self, seq: Sequence) -> str | None:
        """Queue a request; None when queued, else why it was refused (the queue, or its owner's
        share of it, is full)."""
        with self._lock:
            if len(self.queue) >= self.cfg.max_queue:
                return f"engine queue is full ({self.cfg.max_queue} waiting)"
            # what the batch's free slots take at the next step hardly waits: a burst into an
            # idle engine is not refused, while a full batch holds each owner to its share
            free = max(self.cfg.max_batch - len(self.running), 0)
            if self.queue.depth(seq.owner) >= self.cfg.max_queue_per_key + free:
                return (
                    f"too many requests of this API key are waiting ({self.cfg.max_queue_per_key})"
                )
            self.queue.push(seq)
        return None

    @property
    def busy(self) -> bool:
        """Whether a request waits or runs."""
        return bool(self.queue or self.running)

    def close(self) -> list[Sequence]:
        """Empty the queue and the batch (the engine is closing); returns who was in them."""
        with self._lock:
            waiting = self.queue.drain()
        running, self.running = self.running, []
        return [*waiting, *running]

    # -- what warm-ups are shown (`Requests`) --------------------------------------------------

    def requests_waiting(self) -> bool:
        return bool(self.queue)

    def slots(self) -> int:
        """Batch slots taken: a request still to fork into n choices holds n; a warm-up one."""
        return sum(s.width for s in self.running) + len(self._warmups.running)

    def runs_session(self, kv_key: str) -> bool:
        return any(s.request.kv_key == kv_key for s in self.running)

    # -- between steps -------------------------------------------------------------------------

    def admit(self) -> None:
        """Admit waiting requests, then warm-ups into what they leave."""
        with self._lock:  # a cancelled request leaves the queue at once, not when it is its turn
            cancelled = [s for s in self.queue if s.request.cancel.is_set()]
            for seq in cancelled:
                self.queue.discard(seq)
        self._admit_requests(cancelled)
        self._warmups.admit(self)

    def _admit_requests(self, cancelled: list[Sequence]) -> None:
        now = time.perf_counter()
        for seq in cancelled:
            post_results(seq, "cancelled", now)
        parked: set[int] = set()  # heavy keys' heads that wait this pass (`_spares_pins`)
        while True:
            if self._warmups.running and self.queue and self.slots() >= self.cfg.max_batch:
                self._warmups.drop("slots")  # a waiting request goes before any warm-up
            with self._lock:
                slots = self.slots()
                if slots < self.cfg.max_batch:
                    seq = next((h for h in self.queue.heads() if id(h) not in parked), None)
                    victim = None
                else:
                    seq, victim = self._slot_claim()
            if seq is None:
                return
            if victim is None and self.running and slots + seq.width > self.cfg.max_batch:
                if self._warmups.drop("slots"):
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
            need = self._kv.need(seq)
            if self._warmups.running and need > self._kv.room_beside_pins():
                self._warmups.drop("kv_pressure")  # before any pin or preemption
            if victim is None and self._spares_pins(seq, need):
                parked.add(id(seq))  # the next owner in turn may still fit
                continue
            staying = [s for s in self.running if s is not victim]
            if staying and self._kv.room_beside(staying) < need:
                # no KV room for the next in turn: an owner with nothing running may still
                # claim memory from the owner holding the most; otherwise wait for one to end
                claim = self._memory_claim()
                if claim is None:
                    return
                seq, victims = claim
                for v in victims:
                    self.preempt(v, "fair_share")
                need = self._kv.need(seq)
                staying = list(self.running)
                victim = None
            if victim is not None:
                self.preempt(victim, "fair_share")
            if staying:  # what the staying sequences leave: the cache gives way, pins too
                self._kv.evict_for(need, staying, seq)
            self._dequeue(seq)
            try:
                self._start(seq)
            except Exception as exc:  # out of the queue, not yet running: fail it here
                log.exception("engine.admit_failed", request_id=req.request_id)
                seq.kv = None
                seq.job.post(EngineError(f"generation failed: {exc}"))

    def _spares_pins(self, seq: Sequence, need: int) -> bool:
        """Whether `seq` waits rather than take other owners' sessions' pinned KV: a heavy key
        that has a sequence running is admitted only into the room that running sequences and
        other owners' pinned blocks leave (its own sessions' pins may go, least recently used
        first: `KVMemory.evict_for`), so its long prompts cannot evict the KV that lets another
        key's next turn skip its history. Heavy: counted so by `StepPlanner.heavy_keys`, or made
        so by this prompt (a burst is admitted before any step classifies it): what its running
        prompts and this one still have to prefill, net of cached prefixes, is over
        `HEAVY_DEMAND_STEPS` steps' budget. With nothing running a key may take pins (it must
        make progress); a light key always may."""
        if need <= self._kv.room_beside_pins():
            return False
        mine = [s for s in self.running if s.owner == seq.owner]
        if not mine:
            return False
        if seq.owner not in self._heavy():
            uncached = seq.known - self._kv.match(seq)
            demand = uncached + sum(s.known - s.fed for s in mine)
            if demand <= HEAVY_DEMAND_STEPS * self.cfg.prefill_chunk_tokens:
                return False
        return need > self._kv.room_beside_others_pins(seq.owner)

    def _slot_claim(self) -> tuple[Sequence | None, Sequence | None]:
        """With the batch full: the first waiting request, in turn order, of an owner with
        nothing running, and whom to preempt for it (the newest sequence of the owner holding
        the most, if that is two or more). (None, None): it waits for a slot to free."""
        victim = newest_of_largest(self.running, _owner, _order)
        if victim is None or sum(s.owner == victim.owner for s in self.running) < 2:
            return None, None
        busy = {s.owner for s in self.running}
        for head in self.queue.heads():
            if head.owner not in busy:
                return head, victim
        return None, None

    def _memory_claim(self) -> tuple[Sequence, list[Sequence]] | None:
        """With too little KV memory for the next in turn: the first waiting request, in turn
        order, of an owner with nothing running, and the sequences to preempt so that it fits
        (the newest of whichever owner holds the most, never an owner's last one). None: it
        waits for memory like everyone else."""
        busy = {s.owner for s in self.running}
        with self._lock:
            head = next((h for h in self.queue.heads() if h.owner not in busy), None)
        if head is None:
            return None
        if head.prompt is None:
            try:
                self._prepare(head)
            except Exception:
                return None  # refused when its turn comes, by the usual path
        need = self._kv.need(head)
        staying = list(self.running)
        room = self._kv.room_beside(staying)
        victims: list[Sequence] = []
        while room < need:
            victim = newest_of_largest(staying, _owner, _order)
            if victim is None or sum(s.owner == victim.owner for s in staying) < 2:
                return None
            staying.remove(victim)
            victims.append(victim)
            room += self._kv.held_by([victim])
        return head, victims

    def _dequeue(self, seq: Sequence, *, served: bool = True) -> None:
        """Take `seq` out of the queue; served (admitted or refused), its owner's turn passes."""
        with self._lock:
            if served:
                self.queue.take(seq)
            else:
                self.queue.discard(seq)

    def _start(self, seq: Sequence) -> None:
        """Admit: a buffer with what KV memory holds of the sequence, a place in the batch."""
        first = seq.order == 0  # preempted, or a choice parked at its fork: admitted before
        kv_key = seq.request.kv_key
        if kv_key is not None:
            self._warmups.take_over(kv_key)
        seq.kv, seq.fed = self._kv.open(seq)
        if first:  # a preempted sequence keeps its admission order (its seniority)
            seq.cached = seq.fed
            seq.admitted = time.perf_counter()
            self._order += 1
            seq.order = self._order
            warmed = self._warmups.warmed(kv_key) if kv_key else None
            if warmed is not None:
                seq.warmed = max(min(seq.cached, warmed[1]) - warmed[0], 0)
        self.running.append(seq)

    # -- during a step -------------------------------------------------------------------------

    def leave(self, seq: Sequence) -> None:
        """Take a finished or failed sequence out of the batch."""
        if seq in self.running:
            self.running.remove(seq)

    def heavy_victim(self) -> Sequence | None:
        """The newest sequence of a heavy key running two or more, if any."""
        counts: dict[str | None, int] = {}
        for s in self.running:
            counts[s.owner] = counts.get(s.owner, 0) + 1
        keys = self._heavy()
        heavy = [s for s in self.running if s.owner in keys and counts[s.owner] >= 2]
        return max(heavy, key=_order) if heavy else None

    def largest_victim(self) -> Sequence | None:
        """The newest sequence of the owner holding the most, while two or more run."""
        if len(self.running) < 2:
            return None
        return newest_of_largest(self.running, _owner, _order)

    def preempt(self, seq: Sequence, reason: str) -> None:
        """Out of the batch, back to the front of its owner's line; its blocks to the cache."""
        self.running.remove(seq)
        self._kv.commit(seq, "none", unpin=None)  # the caller frees what it needs, its own way
        seq.kv, seq.fed = None, 0
        seq.held = 0
        seq.preemptions += 1
        self.preemptions += 1
        with self._lock:
            self.queue.push_front(seq)
        log.info(
            "engine.preempted",
            request_id=seq.request.request_id,
            reason=reason,
            positions=seq.known,
            generated=len(seq.generated),
        )

    def fork(self, seq: Sequence) -> list[Sequence]:
        """The other choices of `seq`'s request, at the end of its prompt: each gets a copy of
        the prompt's KV while the batch has free slots; the rest wait at the front of the
        queue like preempted sequences (the prompt's blocks in the prefix cache for them).
        Returns the siblings that joined the batch."""
        assert seq.kv is not None
        siblings = self._siblings(seq)
        free = self.cfg.max_batch - self.slots()
        joined, parked = [], []
        for sibling in siblings:
            self._order += 1
            sibling.order = self._order
            if free <= 0:
                parked.append(sibling)
                continue
            sibling.kv, sibling.fed = copy_kv(seq.kv, seq.fed, seq.known + GROW), seq.fed
            self.running.append(sibling)
            joined.append(sibling)
            free -= 1
        if parked:
            self._kv.commit(seq, "none", unpin=True)
            with self._lock:
                for sibling in reversed(parked):
                    self.queue.push_front(sibling)
        return joined
