"""Redis as a best-effort cache tier: failures are logged and answered as "unavailable", never
raised.

A cache must not take the gateway down with it. When a Redis call fails (server down, timeout,
refused write), `RedisTier` logs one warning, reports `UNAVAILABLE` to the caller (which then
serves from memory), and skips Redis for `retry_after_s` so a dead server costs one failed
connect per window instead of one per request. The first call after the window tries again;
success logs the recovery. It does not retry failed writes later: a cache entry lost while
Redis was away is simply re-created on the next miss.

Each call has a deadline (`CALL_TIMEOUT_S`, its retry included) and is taken off the request's
Redis budget (`gateway.caching.redis_deadline`): a request whose budget is spent skips Redis
and is served from memory, so a slow cache never holds a request past its bound.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

import structlog

from gateway.caching.redis_deadline import redis_deadline, request_budget

if TYPE_CHECKING:
    from redis.asyncio import Redis

__all__ = ("UNAVAILABLE", "RedisTier", "connect")

log = structlog.get_logger("visiongate.caching")


class _Unavailable:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNAVAILABLE"


UNAVAILABLE: Final = _Unavailable()
# one call, its retry included: past what the socket timeouts allow (2 s a read or a connect,
# one retry), so that it cuts nothing they would not; within a request, its budget is what binds
CALL_TIMEOUT_S = 6.0


def connect(
    redis_url: str, *, connect_timeout_s: float = 1.0, timeout_s: float = 2.0, retries: int = 1
) -> Redis:
    """A redis.asyncio client for bytes values (one node, or a cluster for a `redis+cluster://`
    URL) with short timeouts and few, immediate retries.

    One retry lets a pooled connection that Redis closed (restart, idle timeout) reconnect
    transparently; more would only make a dead server slower to notice.
    """
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from gateway.caching.redis_connections import async_client

    return async_client(
        redis_url,
        socket_connect_timeout=connect_timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), retries),
        decode_responses=False,
    )


class RedisTier:
    __slots__ = ("_down", "_down_until", "_failures", "client", "errors", "retry_after_s", "tier")

    def __init__(self, redis_url: str, *, tier: str, retry_after_s: float = 5.0) -> None:
        from gateway.caching.redis_connections import REDIS_FAILURES

        self.client = connect(redis_url)
        self.tier = tier
        self.retry_after_s = retry_after_s
        self.errors = 0
        self._down = False
        self._down_until = 0.0
        self._failures: tuple[type[BaseException], ...] = REDIS_FAILURES

    @property
    def up(self) -> bool:
        """False while calls are being skipped after a failure."""
        return not self._down

    async def call(self, op: str, fn: Callable[[Redis], Awaitable[Any]]) -> Any:
        """`await fn(client)`, or UNAVAILABLE if Redis failed now or recently."""
        if self._down and time.monotonic() < self._down_until:
            return UNAVAILABLE
        budget = request_budget()
        if budget is not None and budget.left_s <= 0:  # this request waited its time already
            return UNAVAILABLE
        try:
            async with redis_deadline(CALL_TIMEOUT_S):
                result = await fn(self.client)
        except self._failures as exc:
            self.errors += 1
            if not self._down:
                log.warning(
                    "redis_unavailable",
                    tier=self.tier,
                    op=op,
                    error=repr(exc),
                    fallback="memory",
                    retry_after_s=self.retry_after_s,
                )
            else:
                log.debug("redis_still_unavailable", tier=self.tier, op=op, error=repr(exc))
            self._down = True
            self._down_until = time.monotonic() + self.retry_after_s
            return UNAVAILABLE
        if self._down:
            self._down = False
            log.info("redis_recovered", tier=self.tier, op=op)
        return result

    async def aclose(self) -> None:
        await self.client.aclose()


class MemoryFrontedRedis:
    """A memory tier in front of a Redis tier: what a Redis-backed cache or store holds in
    common (the memory tier it promotes into, the Redis tier, the entry TTL, the namespace)."""

    __slots__ = ("_redis", "_ttl_ms", "memory", "namespace", "ttl_s")

    def __init__(
        self,
        memory: Any,
        redis_url: str,
        ttl_s: float,
        namespace: str,
        *,
        tier: str,
        retry_after_s: float = 5.0,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.memory = memory
        self.ttl_s = ttl_s
        self.namespace = namespace
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._redis = RedisTier(redis_url, tier=tier, retry_after_s=retry_after_s)
