"""Per-owner response rate limits: at most N responses per minute per API key.

`MemoryRateLimiter` is a token bucket per owner (one replica's view); `RedisRateLimiter` counts
in a shared fixed one-minute window (INCR, and EXPIRE on the first count, in one single-key
script, so it runs on one Redis or any Redis Cluster node), so the limit holds across gateway
replicas; while Redis is unreachable the limiter lets requests through (and logs it) rather than
refuse every key. A limit of 0 disables limiting. An exhausted owner gets
GatewayError("rate_limited"), HTTP 429, with the seconds to wait in the message.

`limit_of(owner)`, when given, names an owner's own limit (a managed API key's `rpm`), which
replaces the gateway's `per_minute` for that owner; None: the gateway's.

`acquire` returns the owner's `Allowance` after it (limit, what is left, seconds until whole)
and notes it for the `x-ratelimit-*-requests` headers (`gateway.policy.rate_headers`), a
refusal's too; `peek` reads it without taking (the Realtime `rate_limits.updated` event).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from gateway.policy.rate_headers import Allowance, note_requests
from gateway.protocol.errors import GatewayError

__all__ = (
    "SMALL_BODY",
    "MemoryRateLimiter",
    "RateLimiter",
    "RedisRateLimiter",
    "RefusedBytes",
    "counts_as_refused",
    "make_rate_limiter",
    "refused_error",
)

# a request body or WebSocket frame up to this size is always read, even from a key whose
# refused bytes are over `RefusedBytes.limit`
SMALL_BODY = 1024 * 1024


def counts_as_refused(status: int) -> bool:
    """Whether a request answered with HTTP `status` was refused for what it sent: a 4xx but
    429 (the same request may well pass later) and 401 (no key, no owner to count for)."""
    return 400 <= status < 500 and status not in (401, 429)


class RateLimiter(Protocol):
    async def acquire(self, owner: str) -> Allowance | None:
        """Take one response from `owner`'s allowance or raise GatewayError(rate_limited); the
        allowance left (None: no limit)."""

    async def peek(self, owner: str) -> Allowance | None:
        """The allowance left, taking nothing (None: no limit, or it cannot be read)."""

    async def aclose(self) -> None: ...


def _limited(owner: str, per_minute: int, retry_s: float) -> GatewayError:
    note_requests(Allowance(per_minute, 0, retry_s))
    return GatewayError(
        "rate_limited",
        f"rate limit of {per_minute} responses per minute reached; "
        f"retry in {max(retry_s, 0.1):.1f} s",
        retry_after_s=max(retry_s, 1.0),
    )


LimitOf = Callable[[str], "int | None"]


def _limit(per_minute: int, limit_of: LimitOf | None, owner: str) -> int:
    own = limit_of(owner) if limit_of is not None else None
    return per_minute if own is None else own


class MemoryRateLimiter:
    __slots__ = ("_buckets", "_clock", "limit_of", "per_minute")

    def __init__(
        self, per_minute: int, *, clock=time.monotonic, limit_of: LimitOf | None = None
    ) -> None:
        self.per_minute = per_minute
        self.limit_of = limit_of
        self._buckets: dict[str, tuple[float, float]] = {}  # owner -> (tokens, updated_at)
        self._clock = clock

    def _bucket(self, owner: str) -> tuple[int, float, float]:
        """(limit, tokens in the bucket now, now); a limit of 0: none."""
        per_minute = _limit(self.per_minute, self.limit_of, owner)
        now = self._clock()
        if per_minute <= 0:
            return 0, 0.0, now
        tokens, updated = self._buckets.get(owner, (float(per_minute), now))
        return per_minute, min(float(per_minute), tokens + (now - updated) * per_minute / 60), now

    @staticmethod
    def _allowance(per_minute: int, tokens: float) -> Allowance:
        # the bucket is whole again once it has refilled what it lacks
        return Allowance(per_minute, int(tokens), (per_minute - tokens) * 60.0 / per_minute)

    async def acquire(self, owner: str) -> Allowance | None:
        per_minute, tokens, now = self._bucket(owner)
        if per_minute <= 0:
            return None
        if tokens < 1.0:
            self._buckets[owner] = (tokens, now)
            raise _limited(owner, per_minute, (1.0 - tokens) * 60.0 / per_minute)
        self._buckets[owner] = (tokens - 1.0, now)
        allowance = self._allowance(per_minute, tokens - 1.0)
        note_requests(allowance)
        return allowance

    async def peek(self, owner: str) -> Allowance | None:
        per_minute, tokens, _ = self._bucket(owner)
        return self._allowance(per_minute, tokens) if per_minute > 0 else None

    async def aclose(self) -> None:
        self._buckets.clear()


# KEYS: the owner's counter for this minute. One key per script, so it runs on any Redis Cluster
# node that holds it; the expiry is set with the first count, so a counter never outlives 2 min.
_COUNT = """
local n = redis.call('INCR', KEYS[1])
if n == 1 then
  redis.call('EXPIRE', KEYS[1], 120)
end
return n
"""


class RedisRateLimiter:
    __slots__ = ("_count", "_redis", "limit_of", "namespace", "per_minute")

    def __init__(
        self,
        per_minute: int,
        redis_url: str,
        namespace: str = "vg",
        *,
        limit_of: LimitOf | None = None,
    ) -> None:
        from gateway.caching.redis_connections import async_client

        self.per_minute = per_minute
        self.limit_of = limit_of
        self.namespace = namespace
        self._redis = async_client(redis_url, socket_connect_timeout=2.0, socket_timeout=2.0)
        self._count = self._redis.register_script(_COUNT)

    async def acquire(self, owner: str) -> Allowance | None:
        per_minute = _limit(self.per_minute, self.limit_of, owner)
        if per_minute <= 0:
            return None
        now = time.time()
        key = f"{self.namespace}:rate:{owner}:{int(now // 60)}"
        try:
            async with asyncio.timeout(2.5):  # a hung master must not hold every request
                count = await self._count(keys=[key])
        except Exception as exc:  # Redis down: serve rather than refuse everyone
            import structlog

            structlog.get_logger("visiongate.ratelimit").warning(
                "rate_limit_unavailable", error=repr(exc)
            )
            return None
        if int(count) > per_minute:
            raise _limited(owner, per_minute, 60 - now % 60)
        allowance = Allowance(per_minute, per_minute - int(count), 60 - now % 60)
        note_requests(allowance)
        return allowance

    async def peek(self, owner: str) -> Allowance | None:
        per_minute = _limit(self.per_minute, self.limit_of, owner)
        if per_minute <= 0:
            return None
        now = time.time()
        try:
            async with asyncio.timeout(2.5):
                count = await self._redis.get(f"{self.namespace}:rate:{owner}:{int(now // 60)}")
        except Exception:
            return None
        return Allowance(per_minute, max(per_minute - int(count or 0), 0), 60 - now % 60)

    async def aclose(self) -> None:
        await self._redis.aclose()


class RefusedBytes:
    """Per owner, the body bytes of its refused requests over the last `window_s` (gathered a
    second at a time, so an owner holds at most `window_s` entries however fast it sends)."""

    __slots__ = ("_clock", "_owners", "limit", "window_s")

    def __init__(
        self, limit: int, *, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._owners: dict[str, tuple[deque[tuple[float, int]], list[int]]] = {}

    def _expire(self, owner: str, now: float) -> tuple[deque[tuple[float, int]], list[int]] | None:
        entry = self._owners.get(owner)
        if entry is None:
            return None
        events, total = entry
        while events and events[0][0] <= now - self.window_s:
            total[0] -= events.popleft()[1]
        if not events:
            del self._owners[owner]
            return None
        return entry

    def add(self, owner: str, nbytes: int) -> None:
        if nbytes <= 0:
            return
        now = self._clock()
        entry = self._expire(owner, now) or self._owners.setdefault(owner, (deque(), [0]))
        events, total = entry
        # one entry a clock second (at most 60 an owner), stamped with the second's end: its
        # bytes leave the window at most a second late, never early
        stamp = math.floor(now) + 1.0
        if events and events[-1][0] == stamp:
            events[-1] = (stamp, events[-1][1] + nbytes)
        else:
            events.append((stamp, nbytes))
        total[0] += nbytes

    def total(self, owner: str) -> int:
        entry = self._expire(owner, self._clock())
        return entry[1][0] if entry is not None else 0

    def retry_after(self, owner: str) -> float | None:
        """Seconds until `owner`'s total falls below the limit; None while it is below."""
        if self.limit <= 0:
            return None
        now = self._clock()
        entry = self._expire(owner, now)
        if entry is None or entry[1][0] < self.limit:
            return None
        events, total = entry
        left = total[0]
        for at, nbytes in events:
            left -= nbytes
            if left < self.limit:
                return max(at + self.window_s - now, 0.0)
        return self.window_s  # unreachable: the last event takes the total to 0


def refused_error(limit: int, retry_s: float) -> GatewayError:
    """The answer to a large body or frame from a key whose refused bytes reached `limit`."""
    return GatewayError(
        "rate_limited",
        f"this API key's refused requests reached {limit / (1024 * 1024):g} MiB in the last "
        f"minute; its bodies over {SMALL_BODY // 1024} KiB are not read for "
        f"{max(math.ceil(retry_s), 1)} s",
        retry_after_s=retry_s,
    )


def make_rate_limiter(
    per_minute: int, redis_url: str | None, *, limit_of: LimitOf | None = None
) -> RateLimiter:
    if redis_url and (per_minute > 0 or limit_of is not None):
        return RedisRateLimiter(per_minute, redis_url, limit_of=limit_of)
    return MemoryRateLimiter(per_minute, limit_of=limit_of)
