"""KV warm-ups: a session's prompt prefilled into the prefix cache while its user is still typing.

A warm-up (`Scheduler.submit_warmup`: a request with `warm_up` set, `kv_key` its session) is
background work at the lowest priority. It prefills the session's prompt through its latest item,
samples nothing, and its blocks are then pinned for the session (a warm pin, the first pin to
go: `gateway.engine.local.kv.kv_memory`) until its next turn. Warm-ups wait in a queue of their
own (one per session, a newer one replacing it) and are admitted only while no request waits,
into free slots (a quarter of the batch at most) and KV room that running sequences and
sessions' pins leave (`KVMemory.room_beside_pins`). A step gives them only what requests leave
of its budget (`gateway.engine.local.step_plan`).

A waiting request that needs a slot or KV a warm-up holds drops it first, before any preemption
or unpinning (`drop`, asked by admission); the session's own request takes over what its warm-up
has computed so far (committed to the prefix cache, unpinned, at the request's admission:
`take_over`). Every warm-up ends with one `WarmUpResult` posted to its job: warmed, superseded,
dropped (and why) or failed.

`WarmUps` owns the warm-ups' queue and the running ones. It is given the scheduler's config, the
engine's KV memory, the engine loop's lock (its queue is filled from other threads) and
`prepare` (a request's prompt rendered); at admission it is shown the requests' side of the
batch (`Requests`: whether one waits, the slots taken, whether a session's request runs). It
runs on the engine thread, `enqueue` excepted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

import structlog

from gateway.engine.interface import EngineError, WarmUpResult
from gateway.engine.local.sequence import ms

if TYPE_CHECKING:
    import threading

    from gateway.engine.local.kv.kv_memory import KVMemory, Pin
    from gateway.engine.local.sequence import SchedulerConfig, Sequence

__all__ = ("WARMED_KEPT", "Requests", "WarmUps")

log = structlog.get_logger(__name__)

# sessions whose last warm-up is remembered for their next turn's report
WARMED_KEPT = 4096


class Requests(Protocol):
    """What warm-ups are shown of the requests' side of the batch (`Admission`)."""

    def requests_waiting(self) -> bool:
        """Whether a request waits for admission (read under the engine loop's lock)."""

    def slots(self) -> int:
        """Batch slots taken, running warm-ups' included."""

    def runs_session(self, kv_key: str) -> bool:
        """Whether a request of this session is running."""


class WarmUps:
    """The engine's KV warm-ups: queued, running, and what each computed; see the module doc."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVMemory,
        lock: threading.Condition,
        *,
        prepare: Callable[[Sequence], None],
    ) -> None:
        self.cfg = config
        self._kv = kv
        self._lock = lock
        self._prepare = prepare
        self.queue: list[Sequence] = []  # queued, oldest first
        self.running: list[Sequence] = []  # being prefilled
        # session -> (first, end) positions its latest warm-up computed, for the next turn's report
        self._warmed: dict[str, tuple[int, int]] = {}

    @property
    def busy(self) -> bool:
        """Whether any warm-up is queued or running."""
        return bool(self.queue or self.running)

    # -- queued --------------------------------------------------------------------------------

    def enqueue(self, seq: Sequence) -> list[Sequence]:
        """Queue a warm-up, replacing a queued one of the same session; past `max_queue`
        warm-ups the oldest goes. Returns those it replaced (for `dismiss`)."""
        with self._lock:
            key = seq.request.kv_key
            gone = [s for s in self.queue if s.request.kv_key == key]
            self.queue = [s for s in self.queue if s.request.kv_key != key]
            while len(self.queue) >= self.cfg.max_queue:
                gone.append(self.queue.pop(0))
            self.queue.append(seq)
        return gone

    def dismiss(self, seqs: Iterable[Sequence], reason: str) -> None:
        """End warm-ups taken out of the queue before they ran: dropped, for `reason`."""
        for seq in seqs:
            self._end(seq, "dropped", reason=reason)

    def admit(self, requests: Requests) -> None:
        """Admit queued warm-ups while no request waits, into free slots (a quarter of the
        batch at most) and the KV room that running sequences and sessions' pins leave."""
        limit = max(self.cfg.max_batch // 4, 1)
        while True:
            with self._lock:
                if (
                    not self.queue
                    or requests.requests_waiting()
                    or len(self.running) >= limit
                    or requests.slots() >= self.cfg.max_batch
                ):
                    return
                seq = self.queue.pop(0)
            key = seq.request.kv_key
            if seq.request.cancel.is_set():
                self._end(seq, "dropped", reason="cancelled")
                continue
            if key is None or requests.runs_session(key):
                self._end(seq, "superseded")  # the session's own request is running
                continue
            try:
                self._prepare(seq)
            except EngineError as exc:
                self._end(seq, "failed", reason=str(exc))
                continue
            except Exception as exc:
                log.exception("engine.warmup_prepare_failed", request_id=seq.request.request_id)
                self._end(seq, "failed", reason=f"{type(exc).__name__}: {exc}")
                continue
            need = self._kv.need(seq, choices=1)
            if need > self._kv.room_beside_pins():  # never what sessions pin or requests hold
                self._end(seq, "dropped", reason="kv_pressure")
                continue
            self._kv.make_room(need, unpin=False)  # unpinned blocks, then warm pins
            try:
                self._start(seq)
            except Exception as exc:
                log.exception("engine.warmup_admit_failed", request_id=seq.request.request_id)
                seq.kv = None
                self._end(seq, "failed", reason=f"{type(exc).__name__}: {exc}")

    def _start(self, seq: Sequence) -> None:
        seq.kv, seq.fed = self._kv.open(seq)
        seq.cached = seq.fed
        seq.admitted = time.perf_counter()
        self.running.append(seq)

    # -- running -------------------------------------------------------------------------------

    def drop_cancelled(self) -> None:
        """End the running warm-ups whose callers gave up (their buffers freed)."""
        for seq in [s for s in self.running if s.request.cancel.is_set()]:
            self.running.remove(seq)
            seq.kv = None
            self._end(seq, "dropped", reason="cancelled")

    def drop(self, reason: str) -> bool:
        """Give up every running warm-up (their buffers freed); whether there was any."""
        dropped, self.running = self.running, []
        for seq in dropped:
            seq.kv = None
            self._end(seq, "dropped", reason=reason)
        return bool(dropped)

    def complete(self, seq: Sequence) -> None:
        """A running warm-up has fed its whole prompt: its blocks go to the prefix cache,
        pinned warm for its session."""
        if seq in self.running:
            self.running.remove(seq)
            done = self._keep(seq, "warm")
            self._end(seq, "warmed", positions=done)

    def take_over(self, kv_key: str) -> None:
        """The session's own request is being admitted: its queued warm-up is not needed, and
        what a running one computed goes to the prefix cache for the request to reuse."""
        with self._lock:
            queued = [s for s in self.queue if s.request.kv_key == kv_key]
            self.queue = [s for s in self.queue if s.request.kv_key != kv_key]
        for seq in queued:
            self._end(seq, "superseded")
        for seq in [s for s in self.running if s.request.kv_key == kv_key]:
            self.running.remove(seq)
            done = self._keep(seq, "none")
            self._end(seq, "superseded", positions=done)

    def warmed(self, kv_key: str) -> tuple[int, int] | None:
        """The (first, end) positions the session's latest warm-up computed, once: for the
        report of the turn that reuses them."""
        return self._warmed.pop(kv_key, None)

    def _keep(self, seq: Sequence, pin: Pin) -> int:
        """Commit a warm-up's computed positions (never at another session's pins' cost) and
        free its buffer; returns how many the prefix cache holds."""
        n = self._kv.commit(seq, pin, unpin=False)
        seq.kv = None
        key = seq.request.kv_key
        if n and key is not None:
            self._warmed.pop(key, None)
            self._warmed[key] = (seq.cached, n)
            while len(self._warmed) > WARMED_KEPT:  # sessions that never came back
                del self._warmed[next(iter(self._warmed))]
        return n

    def forget(self, kv_key: str) -> None:
        """Drop the session's running warm-up and what its last one computed (between steps)."""
        for seq in [s for s in self.running if s.request.kv_key == kv_key]:
            self.running.remove(seq)
            seq.kv = None
            self._end(seq, "dropped", reason="forgotten")
        self._warmed.pop(kv_key, None)

    def close(self) -> None:
        """The engine is closing: every queued and running warm-up is dropped."""
        with self._lock:
            gone, self.queue = [*self.queue, *self.running], []
        self.running = []
        for seq in gone:
            seq.kv = None
            self._end(seq, "dropped", reason="closed")

    def _end(self, seq: Sequence, outcome: str, *, positions: int = 0, reason: str = "") -> None:
        now = time.perf_counter()
        started = seq.admitted or now
        computed = max(positions - seq.cached, 0) if positions else 0
        seq.job.post(
            WarmUpResult(
                outcome,  # type: ignore[arg-type]
                positions=positions,
                computed=computed,
                queue_ms=ms(started - seq.job.enqueued),
                prefill_ms=ms(now - started) if seq.admitted else 0.0,
                reason=reason,
            )
        )
        log.info(
            "engine.warmup",
            request_id=seq.request.request_id,
            outcome=outcome,
            positions=positions,
            computed=computed,
            reason=reason or None,
        )
