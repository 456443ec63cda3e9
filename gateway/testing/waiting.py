"""Waiting in tests for something another task, thread or process does: poll a condition until
it holds, or give up after a bound that only a hang reaches.

`eventually` is for async tests (the condition may be a coroutine function, such as a Redis
query); `wait_until` is for plain threads. Neither is a timing assertion: the bound is generous,
and the interval only sets how soon after the condition holds the wait returns.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ("eventually", "wait_until")


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout: float = 10.0,
    what: str = "condition",
    *,
    interval: float = 0.01,
) -> None:
    """Return once `condition()` (awaited if it gives an awaitable) is true, checking every
    `interval` seconds; TimeoutError naming `what` once `timeout` seconds have passed. A check
    under way is never cut short."""
    deadline = time.monotonic() + timeout
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(interval)


def wait_until(condition: Any, timeout: float = 10.0) -> bool:
    """Poll `condition()` until true or `timeout` seconds passed; its last value."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return bool(condition())
        time.sleep(0.01)
    return True
