"""Redis SessionStore: sessions shared by every gateway replica and kept across restarts.

Layout (namespace `vg` by default):
  `vg:session:{id}`  the msgpack-encoded `Session`, with the idle TTL as the key's expiry
  `vg:sessions`      sorted set of session ids scored by expiry time (ms, Redis server clock)

The sorted set exists for `count()`: counting with SCAN would walk the whole keyspace on every
gauge read. Keys expire on their own, so `count()` first drops index entries whose expiry has
passed; an id whose key vanished otherwise (eviction under maxmemory) is dropped when its
score passes, so nothing is counted for longer than one TTL after it is gone.

Each write is one Lua script that updates the key and the index together, with times taken
from Redis's clock so replicas with skewed clocks agree. All keys of a store are touched by
those scripts, so on Redis Cluster give the store a hash-tagged namespace (e.g. `{vg}`).

Owner checks happen here, after decoding: a foreign owner gets the same `session_not_found`
as an unknown id and does not refresh the TTL. A value that does not decode is logged and
treated as not found (the next save overwrites it). Redis being unreachable is a
`GatewayError("busy")` (503): unlike the caches, sessions have no memory fallback that would
be correct across replicas.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
import redis.exceptions
import structlog
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from gateway.protocol.errors import GatewayError
from gateway.sessions.session import UPDATE_ATTEMPTS, Session, T, not_found

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

__all__ = ("RedisSessionStore",)

log = structlog.get_logger("visiongate.sessions")

_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: session key, index. ARGV: encoded session, ttl ms, session id.
_SAVE = (
    _NOW_MS
    + """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
return 1
"""
)

# KEYS: session key, index. ARGV: encoded session, ttl ms, session id. Stores only a new id.
_CREATE = (
    _NOW_MS
    + """
if redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2], 'NX') == false then
  return 0
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
return 1
"""
)

# KEYS: session key, index. ARGV: ttl ms, session id. Refreshes only a key that still exists.
_TOUCH = (
    """
if redis.call('PEXPIRE', KEYS[1], ARGV[1]) == 0 then
  return 0
end
"""
    + _NOW_MS
    + """
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[1]), ARGV[2])
return 1
"""
)

# KEYS: session key, index. ARGV: the encoded value the caller checked, session id.
# Deletes only if the value is still the one whose owner was checked.
_DELETE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
"""

# KEYS: session key, index. ARGV: value read, new value, ttl ms, session id. Replaces the value
# only if it is still the one read (compare-and-set), so concurrent writers never lose updates.
_REPLACE = (
    _NOW_MS
    + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[4])
return 1
"""
)

# KEYS: index.
_COUNT = (
    _NOW_MS
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Session)
_FAILURES = (redis.exceptions.RedisError, OSError, TimeoutError)


class RedisSessionStore:
    __slots__ = (
        "_client",
        "_count",
        "_create",
        "_delete",
        "_index",
        "_replace",
        "_save",
        "_touch",
        "_ttl_ms",
        "namespace",
        "ttl_s",
    )

    def __init__(self, redis_url: str, ttl_s: float, namespace: str = "vg") -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self.namespace = namespace
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._index = f"{namespace}:sessions"
        self._client = Redis.from_url(
            redis_url,
            socket_connect_timeout=2.0,
            socket_timeout=5.0,
            decode_responses=False,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
        )
        self._save: AsyncScript = self._client.register_script(_SAVE)
        self._create: AsyncScript = self._client.register_script(_CREATE)
        self._replace: AsyncScript = self._client.register_script(_REPLACE)
        self._touch: AsyncScript = self._client.register_script(_TOUCH)
        self._delete: AsyncScript = self._client.register_script(_DELETE)
        self._count: AsyncScript = self._client.register_script(_COUNT)

    def key(self, owner: str, session_id: str) -> str:
        """Ids are per owner: the owner (a hash of the API key, or "anonymous") is in the key."""
        return f"{self.namespace}:session:{owner}:{session_id}"

    @staticmethod
    def _member(owner: str, session_id: str) -> str:  # the expiry index's entry
        return f"{owner}:{session_id}"

    async def load(self, session_id: str, owner: str) -> Session:
        key = self.key(owner, session_id)
        session, _ = await self._read(key, session_id, owner)
        await self._call(
            "load",
            self._touch(
                keys=[key, self._index], args=[self._ttl_ms, self._member(owner, session_id)]
            ),
        )
        return session

    async def save(self, session: Session) -> None:
        session.updated_at = time.time()
        await self._call(
            "save",
            self._save(
                keys=[self.key(session.owner, session.id), self._index],
                args=[
                    _encoder.encode(session),
                    self._ttl_ms,
                    self._member(session.owner, session.id),
                ],
            ),
        )

    async def update(
        self, session_id: str, owner: str, mutate: Callable[[Session], T]
    ) -> tuple[Session, T]:
        key = self.key(owner, session_id)
        for _ in range(UPDATE_ATTEMPTS):
            session, raw = await self._read(key, session_id, owner)
            result = mutate(session)
            session.updated_at = time.time()
            done = await self._call(
                "update",
                self._replace(
                    keys=[key, self._index],
                    args=[
                        raw,
                        _encoder.encode(session),
                        self._ttl_ms,
                        self._member(owner, session_id),
                    ],
                ),
            )
            if done:
                return session, result
        raise GatewayError(
            "busy", f"session {session_id!r} is being changed by too many writers at once"
        )

    async def create(self, session: Session) -> bool:
        session.updated_at = time.time()
        return bool(
            await self._call(
                "create",
                self._create(
                    keys=[self.key(session.owner, session.id), self._index],
                    args=[
                        _encoder.encode(session),
                        self._ttl_ms,
                        self._member(session.owner, session.id),
                    ],
                ),
            )
        )

    async def delete(self, session_id: str, owner: str) -> bool:
        key = self.key(owner, session_id)
        for _ in range(3):  # the value changed between read and delete: check the owner again
            try:
                _, raw = await self._read(key, session_id, owner)
            except GatewayError as exc:
                if exc.code == "session_not_found":
                    return False
                raise
            deleted = await self._call(
                "delete",
                self._delete(keys=[key, self._index], args=[raw, self._member(owner, session_id)]),
            )
            if deleted:
                return True
        return False

    async def count(self) -> int:
        return int(await self._call("count", self._count(keys=[self._index])))

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _read(self, key: str, session_id: str, owner: str) -> tuple[Session, bytes]:
        raw = await self._call("load", self._client.get(key))
        if raw is None:
            raise not_found(session_id)
        try:
            session = _decoder.decode(raw)
        except msgspec.MsgspecError as exc:
            log.error("session_corrupt", key=key, error=str(exc))
            raise not_found(session_id) from None
        if session.owner != owner or session.id != session_id:
            raise not_found(session_id)
        return session, raw

    async def _call(self, op: str, pending: Awaitable[Any]) -> Any:
        try:
            return await pending
        except _FAILURES as exc:
            log.error("session_store_unavailable", op=op, error=repr(exc))
            raise GatewayError("busy", "session store unavailable, retry shortly") from exc
