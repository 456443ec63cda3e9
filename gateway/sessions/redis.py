"""Redis SessionStore: sessions shared by every gateway replica and kept across restarts.

Layout (namespace `vg` by default), on one Redis or a Redis Cluster alike:
  `vg:session:{t}:<owner>:<id>`  the msgpack-encoded `Session`, with the idle TTL as the key's
                                 expiry
  `vg:sessions:{t}`              the expiry index of bucket `t`: a sorted set of `<owner>:<id>`
                                 scored by expiry time (ms, Redis server clock)

`{t}` is a Redis hash tag naming one of `BUCKETS` buckets: two hex digits of `zlib.crc32` of
`<owner>:<id>`, so every process puts a session in the same bucket. A session key and its
bucket's index share that tag, hence a hash slot, and every write is one Lua script over those
two keys only: atomic on one node, and never CROSSSLOT on a cluster. Buckets, rather than one
index for the whole store, let sessions spread over a cluster's shards (a single index would
pin every session's writes to the one shard holding it).

The indexes exist for `count()`: counting with SCAN would walk the whole keyspace on every
gauge read. `count()` runs one small script per bucket, sent as one non-transactional pipeline
(one round trip per node), each dropping the entries whose expiry has passed before counting.
Keys expire on their own; an entry whose key vanished otherwise (eviction under maxmemory) is
dropped when its score passes, so nothing is counted for longer than one TTL after it is gone.
Times come from Redis's clock so replicas with skewed clocks agree.

A namespace that carries its own hash tag (`{vg}`, once the advice for clusters) still works:
Redis hashes only the first `{...}` of a key, so that tag wins and every key of the store lands
in one slot. That is correct, only not spread. A namespace whose braces do not form such a tag
is refused, as it would split a session key from its index.

Sessions stored under the earlier layout (`vg:session:<owner>:<id>` with one `vg:sessions`
index) are not read: sessions are short-lived, so after an upgrade clients start new ones and
the old keys expire on their own.

Owner checks happen here, after decoding: a foreign owner gets the same `session_not_found`
as an unknown id and does not refresh the TTL. A value that does not decode is logged and
treated as not found (the next save overwrites it). Redis being unreachable, or not answering
within the call's deadline (`timeout_s`, or less when the request's Redis budget is nearly
spent: `gateway.caching.redis_deadline`), is a `GatewayError("busy")` (503): unlike the caches,
sessions have no memory fallback that would be correct across replicas.
"""

from __future__ import annotations

import inspect
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from gateway.caching.redis_connections import REDIS_FAILURES, async_client
from gateway.caching.redis_deadline import redis_deadline
from gateway.protocol.errors import GatewayError
from gateway.sessions.session import UPDATE_ATTEMPTS, Session, T, not_found

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

__all__ = ("BUCKETS", "RedisSessionStore")

log = structlog.get_logger("visiongate.sessions")

# The write scripts below each name one session key and its bucket's index: one hash slot.

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
# Finding the very value it stores means an earlier send of this call landed and only its
# reply was lost (the client retries on a dropped connection): that is success, not a taken id.
_CREATE = (
    _NOW_MS
    + """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  return 1
end
if current then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
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
# Deletes only if the value is still the one whose owner was checked (0: it changed). A key
# already gone after the caller read it is 2, a success: a retried send whose first reply
# was lost (or another deleter that got there first), so delete() stays idempotent.
_DELETE = """
local value = redis.call('GET', KEYS[1])
if value == false then
  redis.call('ZREM', KEYS[2], ARGV[2])
  return 2
end
if value ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
"""

# KEYS: session key, index. ARGV: value read, new value, ttl ms, session id. Replaces the value
# only if it is still the one read (compare-and-set), so concurrent writers never lose updates.
# Finding the new value already there is a retried send whose first reply was lost: success,
# so the caller does not apply its change a second time.
_REPLACE = (
    _NOW_MS
    + """
local current = redis.call('GET', KEYS[1])
if current == ARGV[2] then
  return 1
end
if current ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[4])
return 1
"""
)

# KEYS: one bucket's index.
_COUNT = (
    _NOW_MS
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Session)
_FAILURES = REDIS_FAILURES


STORE_TIMEOUT_S = 5.0  # one store call's deadline, retries included, unless told otherwise


def store_client(redis_url: str, timeout_s: float = STORE_TIMEOUT_S) -> Any:
    """The client of a Redis-backed store (sessions, response records): bytes values, two
    retries with short backoff, socket timeouts no longer than a call's deadline (`timeout_s`,
    which each call also gets as a whole: `redis_deadline`)."""
    return async_client(
        redis_url,
        socket_connect_timeout=min(2.0, timeout_s),
        socket_timeout=timeout_s,
        decode_responses=False,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
    )


BUCKETS = 128  # hash-tagged buckets; enough to spread over any cluster's shards, few to count


def _bucket_tag(member: str) -> str:
    """The bucket's hash tag for an index member: crc32, not `hash()`, so every process agrees."""
    return f"{{{zlib.crc32(member.encode()) % BUCKETS:02x}}}"


def _check_namespace(namespace: str) -> None:
    """Refuses braces that Redis would read as a tag spanning into the key's own bucket tag.

    Redis hashes the text between a key's first `{` and the first `}` after it, if not empty.
    A namespace without `{`, or with a complete non-empty tag, gives a session key and its index
    the same slot; any other `{` would make the hashed text differ between the two."""
    start = namespace.find("{")
    if start >= 0 and namespace.find("}", start + 1) <= start + 1:
        raise ValueError(
            f"session namespace {namespace!r} has a '{{' without a non-empty '{{...}}' hash tag"
        )


class RedisSessionStore:
    __slots__ = (
        "_client",
        "_create",
        "_delete",
        "_replace",
        "_save",
        "_touch",
        "_ttl_ms",
        "index_keys",
        "namespace",
        "timeout_s",
        "ttl_s",
    )

    def __init__(
        self,
        redis_url: str,
        ttl_s: float,
        namespace: str = "vg",
        *,
        timeout_s: float = STORE_TIMEOUT_S,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        _check_namespace(namespace)
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.namespace = namespace
        self._ttl_ms = max(1, int(ttl_s * 1000))
        # every bucket's expiry index, in bucket order: what `count()` walks
        self.index_keys = tuple(
            f"{namespace}:sessions:{{{bucket:02x}}}" for bucket in range(BUCKETS)
        )
        self._client = store_client(redis_url, timeout_s)
        self._save: AsyncScript = self._client.register_script(_SAVE)
        self._create: AsyncScript = self._client.register_script(_CREATE)
        self._replace: AsyncScript = self._client.register_script(_REPLACE)
        self._touch: AsyncScript = self._client.register_script(_TOUCH)
        self._delete: AsyncScript = self._client.register_script(_DELETE)

    def key(self, owner: str, session_id: str) -> str:
        """Ids are per owner: the owner (a hash of the API key, or "anonymous") is in the key,
        after the bucket's hash tag so that braces in an id cannot move it to another slot."""
        member = self._member(owner, session_id)
        return f"{self.namespace}:session:{_bucket_tag(member)}:{member}"

    def index_key(self, owner: str, session_id: str) -> str:
        """The expiry index of the session's bucket: the only other key its scripts touch."""
        return f"{self.namespace}:sessions:{_bucket_tag(self._member(owner, session_id))}"

    def _keys(self, owner: str, session_id: str) -> list[str]:
        return [self.key(owner, session_id), self.index_key(owner, session_id)]

    @staticmethod
    def _member(owner: str, session_id: str) -> str:  # the expiry index's entry
        return f"{owner}:{session_id}"

    async def load(self, session_id: str, owner: str) -> Session:
        key = self.key(owner, session_id)
        session, _ = await self._read(key, session_id, owner)
        await self._call(
            "load",
            self._touch(
                keys=self._keys(owner, session_id),
                args=[self._ttl_ms, self._member(owner, session_id)],
            ),
        )
        return session

    async def save(self, session: Session) -> None:
        session.updated_at = time.time()
        await self._call(
            "save",
            self._save(
                keys=self._keys(session.owner, session.id),
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
                    keys=self._keys(owner, session_id),
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
                    keys=self._keys(session.owner, session.id),
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
                self._delete(
                    keys=self._keys(owner, session_id), args=[raw, self._member(owner, session_id)]
                ),
            )
            if deleted:  # 1: deleted here, 2: gone since it was read
                return True
        return False

    async def count(self) -> int:
        return await self._call("count", self._count_buckets())

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

    async def _count_buckets(self) -> int:
        """Sums every bucket's live entries: one script per bucket (a script may name one slot's
        keys only), all in one non-transactional pipeline, which a cluster client splits into
        one round trip per node. The pipeline sends EVAL, not EVALSHA: redis-py's cluster
        pipeline refuses EVALSHA, as it cannot load a missing script on the right node midway.
        The script is a few lines, and Redis keeps it compiled under its digest."""
        pipe = self._client.pipeline(transaction=False)
        for index in self.index_keys:
            pipe.eval(_COUNT, 1, index)
        return sum(int(reply) for reply in await pipe.execute())

    async def _call(self, op: str, pending: Awaitable[Any]) -> Any:
        try:
            async with redis_deadline(self.timeout_s):
                return await pending
        except _FAILURES as exc:
            log.error("session_store_unavailable", op=op, error=repr(exc))
            raise GatewayError("busy", "session store unavailable, retry shortly") from exc
        finally:
            if inspect.iscoroutine(pending):
                pending.close()  # a no-op once awaited; else it was never started
