"""Stored responses of the Responses API: what `previous_response_id` and `GET /v1/responses/{id}`
find again.

A `ResponseRecord` is small: the response object as it was sent (JSON bytes, served back as
is), its input items (JSON, for `/input_items`), and where its conversation lives: the session
that holds it and the id of that session's last item belonging to the response (its answer, or
its last input item when it has none). The conversation itself stays in the session store; a
record never copies it.

Records are owner-scoped and kept with an idle TTL, as sessions are: another API key's record
reads as unknown, and reading one refreshes it. Two backends side by side, like the session
stores: memory (the embedded default) and Redis (`vg:response:<owner>:<id>`, msgpack). Redis
being unreachable, or not answering within a call's deadline (as the session store's:
`gateway.caching.redis_deadline`), is `GatewayError("busy")`: a record has no memory fallback
that would be right across replicas.

The Redis backend works on one Redis or a Redis Cluster alike: a record is one key, and every
command and script names that key only, so nothing can be CROSSSLOT, and records spread over a
cluster's shards by their own keys (all in one slot only if the namespace is hash-tagged).
"""

from __future__ import annotations

import inspect
import time
from collections import OrderedDict
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec
import structlog

from gateway.caching.redis_connections import REDIS_FAILURES
from gateway.caching.redis_deadline import redis_deadline
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

__all__ = (
    "MemoryResponseStore",
    "RedisResponseStore",
    "ResponseRecord",
    "ResponseStore",
    "make_response_store",
)

log = structlog.get_logger("visiongate.sessions")


class ResponseRecord(msgspec.Struct, omit_defaults=True):
    id: str
    owner: str
    created_at: float
    body: bytes  # the response object as sent (JSON)
    session_id: str | None = None  # the session holding its conversation (None: store=false)
    last_item_id: str | None = None  # that session's last item of this response
    input_items: bytes = b"[]"  # its input items as listed by /input_items (JSON array)


@runtime_checkable
class ResponseStore(Protocol):
    async def get(self, response_id: str, owner: str) -> ResponseRecord | None:
        """The record (its idle TTL refreshed); None if unknown, expired or another key's."""

    async def put(self, record: ResponseRecord) -> None:
        """Store it under its id (last write wins)."""

    async def delete(self, response_id: str, owner: str) -> bool:
        """Remove it; False if it was not there (or not the owner's)."""

    async def aclose(self) -> None: ...


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ResponseRecord)


def make_response_store(
    redis_url: str | None, ttl_s: float, *, timeout_s: float | None = None
) -> ResponseStore:
    """The backend the session store uses: in-process without a Redis URL, else Redis (each
    call within `timeout_s`, the default when None)."""
    if redis_url is None:
        return MemoryResponseStore(ttl_s)
    if timeout_s is None:
        return RedisResponseStore(redis_url, ttl_s)
    return RedisResponseStore(redis_url, ttl_s, timeout_s=timeout_s)


class MemoryResponseStore:
    """Records in this process, within a byte budget: past it the least recently used go first
    (as Redis with an eviction policy would), so stored responses cannot grow memory without
    bound before their TTL ends. Expired records are swept now and then, not on every write."""

    __slots__ = ("_bytes", "_clock", "_records", "_writes", "max_bytes", "ttl_s")

    SWEEP_EVERY = 256  # writes between sweeps of expired records

    def __init__(self, ttl_s: float, *, max_bytes: int = 256 << 20, clock=time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._clock = clock
        # (owner, id) -> (expires_at, encoded record), least recently used first: stored
        # encoded, never shared mutably
        self._records: OrderedDict[tuple[str, str], tuple[float, bytes]] = OrderedDict()
        self._bytes = 0
        self._writes = 0

    async def get(self, response_id: str, owner: str) -> ResponseRecord | None:
        key = (owner, response_id)
        entry = self._records.get(key)
        if entry is None or entry[0] <= self._clock():
            self._drop(key)
            return None
        self._records[key] = (self._clock() + self.ttl_s, entry[1])
        self._records.move_to_end(key)
        return _decoder.decode(entry[1])

    async def put(self, record: ResponseRecord) -> None:
        key = (record.owner, record.id)
        encoded = _encoder.encode(record)
        self._drop(key)
        self._records[key] = (self._clock() + self.ttl_s, encoded)
        self._bytes += len(encoded)
        self._writes += 1
        if self._writes % self.SWEEP_EVERY == 0:
            self._expire()
        while self._bytes > self.max_bytes and len(self._records) > 1:
            oldest = next(iter(self._records))
            self._drop(oldest)

    async def delete(self, response_id: str, owner: str) -> bool:
        if await self.get(response_id, owner) is None:
            return False
        self._drop((owner, response_id))
        return True

    async def aclose(self) -> None:
        self._records.clear()
        self._bytes = 0

    def _drop(self, key: tuple[str, str]) -> None:
        entry = self._records.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry[1])

    def _expire(self) -> None:
        now = self._clock()
        for key in [k for k, (exp, _) in self._records.items() if exp <= now]:
            self._drop(key)


# KEYS: record key. ARGV: the encoded value the caller checked. Deletes only that value.
_DELETE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
return redis.call('DEL', KEYS[1])
"""

_FAILURES = REDIS_FAILURES


class RedisResponseStore:
    __slots__ = ("_client", "_delete", "_ttl_ms", "namespace", "timeout_s", "ttl_s")

    def __init__(
        self,
        redis_url: str,
        ttl_s: float,
        namespace: str = "vg",
        *,
        timeout_s: float | None = None,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        from gateway.sessions.redis import STORE_TIMEOUT_S, store_client

        timeout_s = STORE_TIMEOUT_S if timeout_s is None else timeout_s
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.namespace = namespace
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._client = store_client(redis_url, timeout_s)
        self._delete: AsyncScript = self._client.register_script(_DELETE)

    def key(self, owner: str, response_id: str) -> str:
        """Ids are per owner: the owner (a hash of the API key, or "anonymous") is in the key."""
        return f"{self.namespace}:response:{owner}:{response_id}"

    async def get(self, response_id: str, owner: str) -> ResponseRecord | None:
        key = self.key(owner, response_id)
        found = await self._read(key, response_id, owner)
        if found is None:
            return None
        await self._call("get", self._client.pexpire(key, self._ttl_ms))
        return found[0]

    async def put(self, record: ResponseRecord) -> None:
        await self._call(
            "put",
            self._client.set(
                self.key(record.owner, record.id), _encoder.encode(record), px=self._ttl_ms
            ),
        )

    async def delete(self, response_id: str, owner: str) -> bool:
        key = self.key(owner, response_id)
        for _ in range(3):  # the value changed between read and delete: check the owner again
            found = await self._read(key, response_id, owner)
            if found is None:
                return False
            if await self._call("delete", self._delete(keys=[key], args=[found[1]])):
                return True
        return False

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _read(
        self, key: str, response_id: str, owner: str
    ) -> tuple[ResponseRecord, bytes] | None:
        raw = await self._call("get", self._client.get(key))
        if raw is None:
            return None
        try:
            record = _decoder.decode(raw)
        except msgspec.MsgspecError as exc:
            log.error("response_record_corrupt", key=key, error=str(exc))
            return None
        if record.owner != owner or record.id != response_id:
            return None
        return record, raw

    async def _call(self, op: str, pending: Awaitable[Any]) -> Any:
        try:
            async with redis_deadline(self.timeout_s):
                return await pending
        except _FAILURES as exc:
            log.error("response_store_unavailable", op=op, error=repr(exc))
            raise GatewayError("busy", "response store unavailable, retry shortly") from exc
        finally:
            if inspect.iscoroutine(pending):
                pending.close()  # a no-op once awaited; else it was never started
