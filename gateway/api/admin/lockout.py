"""Backoff for wrong admin keys, per client (the peer address of the connection).

A client may send `FREE_FAILURES` wrong admin keys in a row; each one past that locks it out
for a delay that doubles, from `FIRST_DELAY_S` to `MAX_DELAY_S`. While locked out, its requests
are answered `auth_locked_out` (429, `Retry-After`) before any key is compared, so guessing the
admin key costs at least that long per guess. The right key, once the delay is over, clears the
count. Only a presented key that is wrong counts (a request with none guesses nothing), and
only `unauthorized` outcomes do: a valid API key used as the admin key is `permission_denied`
and is not a guess.

`AdminLockout` keeps the counts in this process, at most `MAX_CLIENTS` of them, the least
recently seen dropped first. `RedisAdminLockout` (a gateway with `redis_url`) keeps them on the
session store's Redis or Redis Cluster, one key a client (`vg:admin-lockout:{<client>}`, a hash
of the count and the end of the delay, gone `FORGET_S` after the last wrong key), so replicas
share them: spreading guesses over replicas buys no more of them. While that Redis does not
answer, it counts in this process instead (and logs it). The peer address is the TCP peer's,
never a client-sent header (`X-Forwarded-For` is anyone's to forge): behind a proxy all
clients share one count, which is why the admin API belongs on a private network.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import structlog

from gateway.protocol.errors import GatewayError

__all__ = (
    "FIRST_DELAY_S",
    "FORGET_S",
    "FREE_FAILURES",
    "MAX_CLIENTS",
    "MAX_DELAY_S",
    "AdminLockout",
    "Lockout",
    "RedisAdminLockout",
    "make_lockout",
)

log = structlog.get_logger("visiongate.admin")

FREE_FAILURES = 10
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 300.0
MAX_CLIENTS = 10_000
FORGET_S = 3600  # a client's count on Redis lives this long after its last wrong key
REDIS_TIMEOUT_S = 2.0


class Lockout(Protocol):
    async def check(self, client: str) -> None: ...
    async def failed(self, client: str) -> None: ...
    async def succeeded(self, client: str) -> None: ...
    async def aclose(self) -> None: ...


def delay_after(failures: int) -> float:
    """The lockout after `failures` wrong keys in a row (0 while they are free)."""
    past = failures - FREE_FAILURES
    return 0.0 if past < 0 else min(MAX_DELAY_S, FIRST_DELAY_S * 2.0 ** min(past, 32))


def locked_out(wait: float) -> GatewayError:
    return GatewayError(
        "auth_locked_out",
        "too many wrong admin keys from this client; retry later",
        retry_after_s=wait,
    )


class AdminLockout:
    """The counts of this process."""

    __slots__ = ("_clients", "_clock")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        # client -> [wrong keys in a row, locked until]
        self._clients: OrderedDict[str, list[float]] = OrderedDict()
        self._clock = clock

    async def check(self, client: str) -> None:
        """GatewayError(auth_locked_out) while `client` is locked out."""
        entry = self._clients.get(client)
        if entry is None:
            return
        wait = entry[1] - self._clock()
        if wait > 0:
            raise locked_out(wait)

    async def failed(self, client: str) -> None:
        entry = self._clients.pop(client, None) or [0.0, 0.0]
        entry[0] += 1
        delay = delay_after(int(entry[0]))
        if delay:
            entry[1] = self._clock() + delay
        self._clients[client] = entry
        while len(self._clients) > MAX_CLIENTS:
            self._clients.popitem(last=False)

    async def succeeded(self, client: str) -> None:
        self._clients.pop(client, None)

    async def aclose(self) -> None:
        self._clients.clear()


# KEYS: the client's hash. ARGV: now (unix s), FREE_FAILURES, FIRST_DELAY_S, MAX_DELAY_S,
# FORGET_S. The count goes up by one; past the free ones the delay doubles from the first.
_FAILED = """
local n = redis.call('HINCRBY', KEYS[1], 'n', 1)
local past = n - tonumber(ARGV[2])
if past >= 0 then
  local delay = math.min(tonumber(ARGV[4]), tonumber(ARGV[3]) * 2 ^ math.min(past, 32))
  redis.call('HSET', KEYS[1], 'until', tostring(tonumber(ARGV[1]) + delay))
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5]))
return n
"""


class RedisAdminLockout:
    """The counts of every replica on one Redis or Redis Cluster (wall-clock times)."""

    __slots__ = ("_clock", "_failed", "_local", "_redis", "namespace")

    def __init__(
        self, redis_url: str, namespace: str = "vg", *, clock: Callable[[], float] = time.time
    ) -> None:
        from gateway.caching.redis_connections import async_client

        self.namespace = namespace
        self._clock = clock
        self._redis = async_client(redis_url, socket_connect_timeout=2.0, socket_timeout=2.0)
        self._failed = self._redis.register_script(_FAILED)
        self._local = AdminLockout(clock)  # while Redis does not answer

    def key(self, client: str) -> str:
        return f"{self.namespace}:admin-lockout:{{{client}}}"

    async def check(self, client: str) -> None:
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                until = await self._redis.hget(self.key(client), "until")
        except Exception as exc:
            log.warning("admin_lockout_unavailable", error=type(exc).__name__)
            await self._local.check(client)
            return
        wait = float(until) - self._clock() if until is not None else 0.0
        if wait > 0:
            raise locked_out(wait)
        await self._local.check(client)  # what was counted here while Redis was away

    async def failed(self, client: str) -> None:
        args = [self._clock(), FREE_FAILURES, FIRST_DELAY_S, MAX_DELAY_S, FORGET_S]
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await self._failed(keys=[self.key(client)], args=args)
        except Exception as exc:
            log.warning("admin_lockout_unavailable", error=type(exc).__name__)
            await self._local.failed(client)

    async def succeeded(self, client: str) -> None:
        await self._local.succeeded(client)
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await self._redis.delete(self.key(client))
        except Exception as exc:
            log.warning("admin_lockout_unavailable", error=type(exc).__name__)

    async def aclose(self) -> None:
        await self._redis.aclose()


def make_lockout(redis_url: str | None) -> Lockout:
    """On the session store's backend: in-process without a Redis URL, else Redis."""
    return AdminLockout() if redis_url is None else RedisAdminLockout(redis_url)
