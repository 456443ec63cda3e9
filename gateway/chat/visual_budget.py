"""Adaptive visual-token budget: fewer visual tokens for new images while TTFT is over its goal.

Opt-in (`visual_budget_adaptive`). `VisualBudget` watches the time to first token the gateway
measures for each response over a short window; while the window's P95 is above the objective
(`visual_budget_ttft_ms`, the SLO the alert rules use) it lowers the keep-ratio cap new images
are encoded with by one step (`visual_budget_step`) at a time, down to `visual_budget_floor`,
and raises it again, step by step, once the P95 is back under the objective. A step waits for
the last one to show in the window (`hold_s`) before the next.

What it trades: a prompt with fewer visual tokens is prefilled sooner (and its KV is smaller),
at the price of detail in the images sent while the gateway is overloaded; the answer is then
about a coarser image. Images already encoded keep their tokens, so a conversation's KV stays
reusable; only new images get the smaller budget.

`BudgetedEncoder` wraps an in-process encoder whose `encode` takes `max_keep_ratio`. Tokens made
under a cap are other content: they carry their budget's fingerprint, and the vision cache keys
them by it (`fingerprints` lists every level's, the full one first, for lookups).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog

__all__ = ("BudgetedEncoder", "VisualBudget")

log = structlog.get_logger("visiongate.budget")


class VisualBudget:
    """The keep-ratio cap in force, from recent TTFTs against the objective."""

    def __init__(
        self,
        *,
        objective_ms: float,
        ceiling: float,
        floor: float,
        step: float = 0.1,
        window_s: float = 30.0,
        hold_s: float = 5.0,
        min_samples: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 < floor <= ceiling:
            raise ValueError(f"need 0 < floor <= ceiling, got floor {floor}, ceiling {ceiling}")
        if step <= 0.0 or objective_ms <= 0.0 or window_s <= 0.0:
            raise ValueError("step, objective_ms and window_s must be > 0")
        self.objective_ms = objective_ms
        levels = [ceiling]
        while levels[-1] - step > floor + 1e-9:
            levels.append(round(levels[-1] - step, 6))
        if levels[-1] > floor:
            levels.append(floor)
        self.levels = tuple(levels)  # caps from the full budget down to the floor
        self.window_s, self.hold_s, self.min_samples = window_s, hold_s, min_samples
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque()  # (time, ttft ms)
        self._level = 0
        self._changed = -float("inf")

    @property
    def cap(self) -> float | None:
        """The keep-ratio cap for new images; None: the configured budget (no burn)."""
        return None if self._level == 0 else self.levels[self._level]

    @property
    def in_force(self) -> float:
        """The keep-ratio cap in force, the full budget's included."""
        return self.levels[self._level]

    def p95_ms(self) -> float | None:
        """P95 of the window's TTFTs; None with fewer than `min_samples`."""
        self._expire(self._clock())
        if len(self._samples) < self.min_samples:
            return None
        ordered = sorted(v for _, v in self._samples)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]

    def observe(self, ttft_ms: float) -> None:
        """One response's TTFT; the cap moves one step if the window says so."""
        now = self._clock()
        self._samples.append((now, float(ttft_ms)))
        p95 = self.p95_ms()
        if p95 is None or now - self._changed < self.hold_s:
            return
        burning = p95 > self.objective_ms
        if burning and self._level < len(self.levels) - 1:
            self._move(1, now, p95)
        elif not burning and self._level > 0:
            self._move(-1, now, p95)

    def _move(self, by: int, now: float, p95: float) -> None:
        self._level += by
        self._changed = now
        # what was measured under the old budget no longer says what the new one does
        self._samples.clear()
        log.info(
            "visual_budget",
            keep_ratio_cap=self.in_force,
            p95_ttft_ms=round(p95, 1),
            objective_ms=self.objective_ms,
        )

    def _expire(self, now: float) -> None:
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()


class BudgetedEncoder:
    """An in-process encoder whose new images get the budget's keep-ratio cap."""

    def __init__(self, inner: Any, budget: VisualBudget, metrics: Any = None) -> None:
        self.inner = inner
        self.budget = budget
        self.metrics = metrics
        self.remote = getattr(inner, "remote", False)
        # every level's fingerprint, the full budget's first (vision-cache lookups try each)
        self.fingerprints = tuple(
            dict.fromkeys(
                [inner.fingerprint, *(inner.fingerprint_for(c) for c in budget.levels[1:])]
            )
        )

    @property
    def fingerprint(self) -> str:
        return self.inner.fingerprint

    def __getattr__(self, name: str) -> Any:  # start, aclose, queue_depth, config, ...
        return getattr(self.inner, name)

    def observe_ttft(self, ttft_ms: float) -> None:
        self.budget.observe(ttft_ms)

    async def encode(
        self, data: bytes, *, traceparent: str | None = None, owner: str | None = None
    ) -> Any:
        cap = self.budget.cap
        if self.metrics is not None:
            self.metrics.record_visual_budget(keep_ratio_cap=self.budget.in_force)
        return await self.inner.encode(
            data, traceparent=traceparent, owner=owner, max_keep_ratio=cap
        )
