"""Single-flight: concurrent callers for one key share one call.

`SingleFlight.do(key, fn)` runs `fn()` once per key at a time; callers that arrive while it is
running await the same result. It caches nothing: once the call finishes (value or exception)
the key is free, and the next `do` runs `fn` again. Failures reach every waiter of that call.

The shared work runs in its own task, started in the first caller's context (contextvars such
as the current trace span come from that caller). A cancelled waiter leaves without cancelling
the work while other waiters remain; when the last waiter leaves, the work is cancelled too
unless `cancel_abandoned=False` (then it runs to completion, e.g. to fill a cache).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from functools import partial
from typing import Generic, TypeVar

__all__ = ("SingleFlight",)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Call(Generic[V]):
    __slots__ = ("task", "waiters")

    def __init__(self, task: asyncio.Task[V]) -> None:
        self.task = task
        self.waiters = 0


async def _run(fn: Callable[[], Awaitable[V]]) -> V:
    return await fn()


class SingleFlight(Generic[K, V]):
    __slots__ = ("_calls", "cancel_abandoned")

    def __init__(self, *, cancel_abandoned: bool = True) -> None:
        self.cancel_abandoned = cancel_abandoned
        self._calls: dict[K, _Call[V]] = {}

    def __len__(self) -> int:
        """Keys with a call in flight."""
        return sum(1 for call in self._calls.values() if not call.task.done())

    def in_flight(self, key: K) -> bool:
        return self._live(key) is not None

    async def do(self, key: K, fn: Callable[[], Awaitable[V]]) -> V:
        """The result of `fn()`, shared with every concurrent caller for `key`."""
        call = self._live(key)
        if call is None:
            task = asyncio.create_task(_run(fn), name=f"singleflight {str(key)[:40]}")
            call = _Call(task)
            self._calls[key] = call
            task.add_done_callback(partial(self._finished, key, call))
        return await self._join(key, call)

    async def wait(self, key: K) -> V | None:
        """Join the call in flight for `key` and return its result; None if there is none."""
        call = self._live(key)
        if call is None:
            return None
        return await self._join(key, call)

    def _live(self, key: K) -> _Call[V] | None:
        call = self._calls.get(key)
        # A finished call stays in the dict until its done-callback runs; it is not joinable.
        if call is None or call.task.done():
            return None
        return call

    async def _join(self, key: K, call: _Call[V]) -> V:
        call.waiters += 1
        try:
            return await asyncio.shield(call.task)
        finally:
            call.waiters -= 1
            if call.waiters == 0 and not call.task.done() and self.cancel_abandoned:
                # Nobody wants the result any more. Free the key now, so a caller arriving
                # while the cancellation unwinds starts a fresh call instead of joining this one.
                if self._calls.get(key) is call:
                    del self._calls[key]
                call.task.cancel()

    def _finished(self, key: K, call: _Call[V], task: asyncio.Task[V]) -> None:
        if self._calls.get(key) is call:
            del self._calls[key]
        if not task.cancelled():
            task.exception()  # retrieved here: a failure nobody awaited is not an unhandled error
