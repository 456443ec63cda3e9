"""Deadlines for Redis calls: each call has one, and one request's calls share a budget.

A stalled Redis (a long `DEBUG SLEEP`, a fork under memory pressure, a network partition) must
not hold a request for as long as its socket timeouts allow, once per call and retry. So:

- `redis_deadline(timeout_s)` bounds one call, its client's retries included: past the
  deadline the call is cancelled (redis-py then drops the connection, never reusing one with a
  reply still unread) and `RedisDeadlineExceeded` is raised, a `TimeoutError` that the stores
  answer as they answer Redis being down.
- `open_request_budget(total_s)` gives the current task (an HTTP request's, a Realtime client
  event's; tasks started from it share it) the most time its Redis calls may take together.
  Each call's deadline is then the smaller of its own timeout and what is left, and the time a
  call took is taken off; once nothing is left, a call fails at once. A request whose store is
  slow therefore ends within the budget plus its own work, instead of once per call.

The budget is set, not entered and left: every request runs in a task of its own (uvicorn's),
and a Realtime connection opens a new budget for each client event. A streamed HTTP body may be
sent from another task than its handler's, so the stream takes its request's budget along
(`use_request_budget`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextvars import ContextVar

__all__ = (
    "RedisBudget",
    "RedisDeadlineExceeded",
    "open_request_budget",
    "redis_deadline",
    "request_budget",
    "use_request_budget",
)


class RedisDeadlineExceeded(TimeoutError):
    """A Redis call that did not finish within its deadline (or found the budget spent)."""


class RedisBudget:
    """What one request may still spend waiting for Redis, in seconds."""

    __slots__ = ("left_s", "total_s")

    def __init__(self, total_s: float) -> None:
        if not total_s > 0:
            raise ValueError(f"a Redis budget must be > 0 s, got {total_s}")
        self.total_s = total_s
        self.left_s = total_s

    def __repr__(self) -> str:
        return f"RedisBudget({self.left_s:.3f}/{self.total_s:g} s left)"


_budget: ContextVar[RedisBudget | None] = ContextVar("visiongate_redis_budget", default=None)


def open_request_budget(total_s: float) -> RedisBudget:
    """Give the current task (and the tasks it starts from now on) a fresh budget."""
    budget = RedisBudget(total_s)
    _budget.set(budget)
    return budget


def use_request_budget(budget: RedisBudget) -> None:
    """Carry a request's budget on in the current task: a streamed HTTP body may be sent from
    a task other than the one its handler ran in."""
    _budget.set(budget)


def request_budget() -> RedisBudget | None:
    """The current task's budget; None outside a request (background work)."""
    return _budget.get()


@contextlib.asynccontextmanager
async def redis_deadline(timeout_s: float) -> AsyncIterator[None]:
    """Run the block (one Redis call) within `timeout_s`, or less when the request's budget is
    nearly spent; `RedisDeadlineExceeded` past it. The time it took is taken off the budget."""
    budget = _budget.get()
    limit = timeout_s if budget is None else min(timeout_s, budget.left_s)
    if limit <= 0:
        raise RedisDeadlineExceeded("this request's time for Redis calls is spent")
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(limit):
            yield
    except TimeoutError as exc:
        if isinstance(exc, RedisDeadlineExceeded):
            raise
        raise RedisDeadlineExceeded(f"no answer from Redis within {limit:.2f} s") from exc
    finally:
        if budget is not None:
            budget.left_s -= time.monotonic() - t0
