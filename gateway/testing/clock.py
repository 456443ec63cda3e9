"""A clock that moves only when told: pass it as `clock=` to anything that reads the time
through a callable (the limiters, the key store's cache, the body guard, the visual budget)."""

from __future__ import annotations

__all__ = ("ManualClock",)


class ManualClock:
    """Returns `now` when called; set `now` or `advance()` it."""

    __slots__ = ("now",)

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now
