"""The scheduler gauges: an engine's `SchedulerStats` snapshot read at each collection.

An engine without one (no ``stats()``) exports no scheduler series. KV blocks are split into
three states that add up to the pool: ``used`` (held by running requests), ``cached``
(unreferenced but holding reusable prefix KV, so allocatable at the cost of the reuse) and
``free`` (empty). A failing snapshot never breaks a scrape: that collection has no scheduler
series, and the failure is logged once per run of failures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import structlog
from opentelemetry.metrics import CallbackOptions, Observation

__all__ = ("SchedulerStats", "scheduler_callbacks")

log = structlog.get_logger(__name__)


class SchedulerStats(Protocol):
    """What the scheduler gauges read (`gateway.engine.interface.EngineStats` has these fields)."""

    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def step_tokens(self) -> int: ...
    @property
    def kv_blocks_used(self) -> int: ...
    @property
    def kv_blocks_total(self) -> int: ...
    @property
    def kv_blocks_cached(self) -> int: ...
    @property
    def preemptions_total(self) -> int: ...


def _kv_block_states(stats: SchedulerStats) -> dict[str, int]:
    """used + cached + free == total; ``free`` never goes negative on a torn snapshot."""
    used, cached = int(stats.kv_blocks_used), int(stats.kv_blocks_cached)
    return {
        "used": used,
        "cached": cached,
        "free": max(int(stats.kv_blocks_total) - used - cached, 0),
    }


def scheduler_callbacks(
    engine_stats: Callable[[], SchedulerStats | None],
) -> list[tuple[str, Callable[[CallbackOptions], Iterable[Observation]]]]:
    """One callback per scheduler instrument, each reading a fresh snapshot. A failing
    ``engine_stats`` is logged once per run of failures, not once per instrument and scrape."""
    failing = False

    def snapshot() -> SchedulerStats | None:
        nonlocal failing
        try:
            stats = engine_stats()
        except Exception:  # a gauge must never break a scrape
            if not failing:
                log.warning("engine_stats_failed", exc_info=True)
            failing = True
            return None
        failing = False
        return stats

    def observe(
        read: Callable[[SchedulerStats], Iterable[Observation]],
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(_: CallbackOptions) -> Iterable[Observation]:
            stats = snapshot()
            return [] if stats is None else list(read(stats))

        return callback

    return [
        (
            "visiongate.scheduler.requests",
            observe(
                lambda s: [
                    Observation(int(s.running), {"state": "running"}),
                    Observation(int(s.waiting), {"state": "waiting"}),
                ]
            ),
        ),
        ("visiongate.scheduler.batch.size", observe(lambda s: [Observation(int(s.batch_size))])),
        ("visiongate.scheduler.step.tokens", observe(lambda s: [Observation(int(s.step_tokens))])),
        (
            "visiongate.kv.blocks",
            observe(
                lambda s: [
                    Observation(n, {"state": state}) for state, n in _kv_block_states(s).items()
                ]
            ),
        ),
        (
            "visiongate.scheduler.preemptions",
            observe(lambda s: [Observation(int(s.preemptions_total))]),
        ),
    ]
