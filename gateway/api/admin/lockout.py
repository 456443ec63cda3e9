"""Backoff for wrong admin keys, per client (its address: gateway/server/client_address.py).

A client may send `FREE_FAILURES` wrong admin keys in a row; from the last of those on, each
one locks it out for a delay that doubles, from `FIRST_DELAY_S` to `MAX_DELAY_S`. While locked
out, its requests are answered `auth_locked_out` (429, `Retry-After`) before any key is
compared, so guessing the admin key costs at least that long per guess. A presented key is
counted before it is compared (`attempt`, one atomic step with the check), so a burst of
guesses sent at once gets the free ones and no more; the right key then clears the count
(`succeeded`), and a valid API key used as the admin key (`permission_denied`, no guess) takes
its count back (`forgive`). A request with no key guesses nothing and is only checked.
IPv6 clients count by their /64, IPv4-mapped IPv6 ones (`::ffff:a.b.c.d`) by their IPv4 address
(`client_of`).

`AdminLockout` keeps the counts in this process, at most `MAX_CLIENTS` of them, the least
recently seen dropped first. `RedisAdminLockout` (a gateway with `redis_url`) keeps them on the
session store's Redis or Redis Cluster, one key a client (`vg:admin-lockout:{<client>}`, a hash
of the count and the end of the delay, gone `FORGET_S` after the last wrong key), so replicas
share them: spreading guesses over replicas buys no more of them. While that Redis does not
answer, it counts in this process instead (and logs it). The address is the TCP peer's unless
that peer is one of `trusted_proxies`; then it is the hop that proxy's forwarding header names
(the rightmost one that is not itself a trusted proxy). A header from any other peer is not
read (`X-Forwarded-For` is anyone's to forge), so behind a proxy that is not listed all clients
share the proxy's count, which is one more reason the admin API belongs on a private network.
"""

from __future__ import annotations

import asyncio
import ipaddress
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
    "client_of",
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
    async def attempt(self, client: str) -> None: ...
    async def forgive(self, client: str) -> None: ...
    async def succeeded(self, client: str) -> None: ...
    async def aclose(self) -> None: ...


def delay_after(attempts: int) -> float:
    """The lockout once `attempts` keys in a row were counted (0 while they are free)."""
    past = attempts - FREE_FAILURES
    return 0.0 if past < 0 else min(MAX_DELAY_S, FIRST_DELAY_S * 2.0 ** min(past, 32))


def locked_out(wait: float) -> GatewayError:
    return GatewayError(
        "auth_locked_out",
        "too many wrong admin keys from this client; retry later",
        retry_after_s=wait,
    )


def client_of(address: str) -> str:
    """The count a client address belongs to: an IPv6 address counts with its /64 (one host
    holds a whole /64, and would otherwise get a fresh count per address), IPv4 by itself, and
    an IPv4-mapped IPv6 address as the IPv4 address it is (not with every other mapped one in
    `::ffff:0:0/64`)."""
    try:
        parsed = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv4Address):
        return str(parsed)
    if parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    return str(ipaddress.IPv6Network(f"{parsed}/64", strict=False))


class AdminLockout:
    """The counts of this process. Each step runs without awaiting, so concurrent requests of
    one client are counted one after the other."""

    __slots__ = ("_clients", "_clock")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        # client -> [keys counted in a row, locked until]
        self._clients: OrderedDict[str, list[float]] = OrderedDict()
        self._clock = clock

    async def check(self, client: str) -> None:
        """GatewayError(auth_locked_out) while `client` is locked out."""
        entry = self._clients.get(client)
        if entry is not None and (wait := entry[1] - self._clock()) > 0:
            raise locked_out(wait)

    async def attempt(self, client: str) -> None:
        """`check`, then count the key about to be compared, in one step: of a burst of guesses
        sent at once, those past the free ones are refused, not compared."""
        await self.check(client)
        entry = self._clients.pop(client, None) or [0.0, 0.0]
        entry[0] += 1
        delay = delay_after(int(entry[0]))
        if delay:
            entry[1] = self._clock() + delay
        self._clients[client] = entry
        while len(self._clients) > MAX_CLIENTS:
            self._clients.popitem(last=False)

    async def forgive(self, client: str) -> None:
        """The key counted was no guess (a valid API key, refused as the admin key)."""
        entry = self._clients.get(client)
        if entry is not None:
            entry[0] = max(entry[0] - 1, 0)
            if not delay_after(int(entry[0])):
                entry[1] = 0.0

    async def succeeded(self, client: str) -> None:
        self._clients.pop(client, None)

    async def aclose(self) -> None:
        self._clients.clear()


# KEYS: the client's hash. ARGV: now (unix s), FREE_FAILURES, FIRST_DELAY_S, MAX_DELAY_S,
# FORGET_S. While locked: the seconds left. Else the count goes up by one (past the free ones
# the delay doubles from the first) and 0.
_ATTEMPT = """
local now = tonumber(ARGV[1])
local locked = tonumber(redis.call('HGET', KEYS[1], 'until') or '0')
if locked > now then return tostring(locked - now) end
local n = redis.call('HINCRBY', KEYS[1], 'n', 1)
local past = n - tonumber(ARGV[2])
if past >= 0 then
  local delay = math.min(tonumber(ARGV[4]), tonumber(ARGV[3]) * 2 ^ math.min(past, 32))
  redis.call('HSET', KEYS[1], 'until', tostring(now + delay))
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5]))
return '0'
"""

# KEYS: the client's hash. ARGV: FREE_FAILURES. One count back; below the free ones, no lock.
_FORGIVE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local n = redis.call('HINCRBY', KEYS[1], 'n', -1)
if n < 0 then redis.call('HSET', KEYS[1], 'n', 0) end
if n < tonumber(ARGV[1]) then redis.call('HDEL', KEYS[1], 'until') end
return 1
"""


class RedisAdminLockout:
    """The counts of every replica on one Redis or Redis Cluster (wall-clock times), each step
    one script on one key."""

    __slots__ = ("_attempt", "_clock", "_forgive", "_local", "_redis", "namespace")

    def __init__(
        self, redis_url: str, namespace: str = "vg", *, clock: Callable[[], float] = time.time
    ) -> None:
        from gateway.caching.redis_connections import async_client

        self.namespace = namespace
        self._clock = clock
        self._redis = async_client(redis_url, socket_connect_timeout=2.0, socket_timeout=2.0)
        self._attempt = self._redis.register_script(_ATTEMPT)
        self._forgive = self._redis.register_script(_FORGIVE)
        self._local = AdminLockout(clock)  # while Redis does not answer

    def key(self, client: str) -> str:
        return f"{self.namespace}:admin-lockout:{{{client}}}"

    async def check(self, client: str) -> None:
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                locked = await self._redis.hget(self.key(client), "until")
            wait = float(locked) - self._clock() if locked is not None else 0.0
        except Exception as exc:
            log.warning("admin_lockout_unavailable", error=type(exc).__name__)
            wait = 0.0
        if wait > 0:
            raise locked_out(wait)
        await self._local.check(client)  # what was counted here while Redis was away

    async def attempt(self, client: str) -> None:
        args = [self._clock(), FREE_FAILURES, FIRST_DELAY_S, MAX_DELAY_S, FORGET_S]
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                wait = float(await self._attempt(keys=[self.key(client)], args=args))
        except Exception as exc:
            log.warning("admin_lockout_unavailable", error=type(exc).__name__)
            await self._local.attempt(client)
            return
        if wait > 0:
            raise locked_out(wait)
        await self._local.check(client)

    async def forgive(self, client: str) -> None:
        await self._local.forgive(client)
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await self._forgive(keys=[self.key(client)], args=[FREE_FAILURES])
        except Exception as exc:
            log.warning("admin_lockout_unavailable", error=type(exc).__name__)

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
