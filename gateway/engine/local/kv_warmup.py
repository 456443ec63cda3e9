"""KV warm-ups: a session's prompt prefilled into the prefix cache while its user is still typing.

A warm-up (`submit_warmup`: a request with `warm_up` set, `kv_key` its session) is background
work at the lowest priority. It prefills the session's prompt through its latest item, samples
nothing, and its blocks are then pinned for the session (a warm pin, the first pin to go) until
its next turn. Warm-ups wait in a queue of their own (one per session, a newer one replacing it)
and are admitted only while no request waits, into free slots (a quarter of the batch at most)
and KV room that running sequences and sessions' pins leave (`KVBudget.room_beside_pins`). A
step gives them only what requests leave of its budget (`gateway.engine.local.step_plan`).

A waiting request that needs a slot or KV a warm-up holds drops it first, before any preemption
or unpinning; the session's own request takes over what its warm-up has computed so far
(published to the prefix cache at its admission, `_take_over_warmups`). Every warm-up ends with
one `WarmUpResult` posted to its job: warmed, superseded, dropped (and why) or failed.

`WarmUps` is a part of `Scheduler` (gateway.engine.local.scheduler), written apart for reading:
it runs on the engine thread (`submit_warmup` excepted) and uses the scheduler's queues, batch,
prefix cache and KV budget, which it declares below.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog
import torch

from gateway.engine.interface import EngineError, WarmUpResult
from gateway.engine.local.kv.blocks import block_hashes, position_keys
from gateway.engine.local.sequence import Job, Sequence, ms

if TYPE_CHECKING:
    from gateway.engine.local.fair_queue import FairQueue
    from gateway.engine.local.kv.budget import KVBudget
    from gateway.engine.local.kv.prefix_cache import PrefixCache
    from gateway.engine.local.sequence import SchedulerConfig

__all__ = ("WARMED_KEPT", "WarmUps")

log = structlog.get_logger(__name__)

# sessions whose last warm-up is remembered for their next turn's report
WARMED_KEPT = 4096


class WarmUps:
    """The scheduler's KV warm-ups (see the module doc); mixed into `Scheduler`."""

    # the scheduler's, shared with its other parts
    cfg: SchedulerConfig
    cache: PrefixCache
    budget: KVBudget
    warmups_dropped: int
    _cond: threading.Condition
    _stop: bool
    _waiting: FairQueue[Sequence]
    _running: list[Sequence]
    _warm_waiting: list[Sequence]
    _warming: list[Sequence]
    _warmed: dict[str, tuple[int, int]]
    _slots: Callable[[], int]
    _prepare: Callable[[Sequence], None]
    _start: Callable[[Sequence], None]
    call_between_steps: Callable[[Callable[[], None]], None]

    def submit_warmup(self, job: Job) -> None:
        """Queue a KV warm-up (`job.request.warm_up` set, `kv_key` its session); its
        `WarmUpResult` is posted to `job` when it ends. A queued warm-up of the same session is
        replaced (dropped); past `max_queue` warm-ups, the oldest is dropped."""
        seq = Sequence(job)
        gone: list[Sequence] = []
        with self._cond:
            if self._stop:
                raise EngineError("engine closed", code="closed")
            key = job.request.kv_key
            gone = [s for s in self._warm_waiting if s.request.kv_key == key]
            self._warm_waiting = [s for s in self._warm_waiting if s.request.kv_key != key]
            while len(self._warm_waiting) >= self.cfg.max_queue:
                gone.append(self._warm_waiting.pop(0))
            self._warm_waiting.append(seq)
            self._cond.notify()
        for old in gone:
            self._warm_end(old, "dropped", reason="replaced")

    def forget(self, kv_key: str) -> None:
        """Drop a session's running warm-up and its cached KV (pins and all), between steps."""

        def drop() -> None:
            for seq in [s for s in self._warming if s.request.kv_key == kv_key]:
                self._warming.remove(seq)
                seq.kv = None
                self._warm_end(seq, "dropped", reason="forgotten")
            self._warmed.pop(kv_key, None)
            self.cache.forget(kv_key)

        self.call_between_steps(drop)

    def _admit_warmups(self) -> None:
        """Admit queued warm-ups while no request waits, into free slots (a quarter of the
        batch at most) and the KV room that running sequences and sessions' pins leave."""
        limit = max(self.cfg.max_batch // 4, 1)
        while True:
            with self._cond:
                if (
                    not self._warm_waiting
                    or self._waiting
                    or len(self._warming) >= limit
                    or self._slots() >= self.cfg.max_batch
                ):
                    return
                seq = self._warm_waiting.pop(0)
            key = seq.request.kv_key
            if seq.request.cancel.is_set():
                self._warm_end(seq, "dropped", reason="cancelled")
                continue
            if key is None or any(s.request.kv_key == key for s in self._running):
                self._warm_end(seq, "superseded")  # the session's own request is running
                continue
            try:
                self._prepare(seq)
            except EngineError as exc:
                self._warm_end(seq, "failed", reason=str(exc))
                continue
            except Exception as exc:
                log.exception("engine.warmup_prepare_failed", request_id=seq.request.request_id)
                self._warm_end(seq, "failed", reason=f"{type(exc).__name__}: {exc}")
                continue
            need = self.budget.need(seq, choices=1)
            if need > self.budget.room_beside_pins():  # never what sessions pin or requests hold
                self._warm_end(seq, "dropped", reason="kv_pressure")
                continue
            self.budget.make_room(need, unpin=False)  # unpinned blocks, then warm pins
            try:
                self._start(seq)
            except Exception as exc:
                log.exception("engine.warmup_admit_failed", request_id=seq.request.request_id)
                seq.kv = None
                self._warm_end(seq, "failed", reason=f"{type(exc).__name__}: {exc}")

    def _drop_warmups(self, reason: str) -> bool:
        """Give up every running warm-up (their buffers freed); whether there was any."""
        dropped, self._warming = self._warming, []
        for seq in dropped:
            seq.kv = None
            self._warm_end(seq, "dropped", reason=reason)
        return bool(dropped)

    def _take_over_warmups(self, kv_key: str) -> None:
        """The session's own request is being admitted: its queued warm-up is not needed, and
        what a running one computed goes to the prefix cache for the request to reuse."""
        with self._cond:
            queued = [s for s in self._warm_waiting if s.request.kv_key == kv_key]
            self._warm_waiting = [s for s in self._warm_waiting if s.request.kv_key != kv_key]
        for seq in queued:
            self._warm_end(seq, "superseded")
        for seq in [s for s in self._warming if s.request.kv_key == kv_key]:
            self._warming.remove(seq)
            done = self._keep_warm(seq, pin=False)
            self._warm_end(seq, "superseded", positions=done)

    def _keep_warm(self, seq: Sequence, *, pin: bool) -> int:
        """Give a warm-up's computed positions to the prefix cache (`pin`: pinned warm for its
        session); returns how many the cache holds."""
        n = seq.fed
        kv, seq.kv = seq.kv, None
        if kv is None or seq.prompt is None or n <= 0 or not self.cache.enabled:
            return 0
        if not bool(torch.isfinite(kv.layers[-1][:, :, :n]).all()):
            log.warning("kv.not_finite", request_id=seq.request.request_id, positions=n)
            return 0
        tokens = seq.prompt.tokens[:n]
        images = [sp for sp in seq.prompt.images if sp.start < n]
        keys = position_keys(tokens, images)
        hashes = block_hashes(tokens, images, self.cfg.block_size, seq.seed)
        kept = self.cache.insert(seq.seed, keys, hashes, kv.layers, n)
        key = seq.request.kv_key
        if key is not None:
            if pin:
                self.cache.pin(key, kept, warm=True)
            self._warmed.pop(key, None)
            self._warmed[key] = (seq.cached, n)
            while len(self._warmed) > WARMED_KEPT:  # sessions that never came back
                del self._warmed[next(iter(self._warmed))]
        self.budget.make_room(unpin=False)  # never at another session's pins' cost
        return n

    def _warm_end(
        self, seq: Sequence, outcome: str, *, positions: int = 0, reason: str = ""
    ) -> None:
        if outcome == "dropped":
            self.warmups_dropped += 1
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
