"""The image store: original image bytes by sha256 digest.

It lets a client refer to an uploaded image later (`visiongate:sha256:<hex>`) and lets the
gateway re-encode an image after a vision-cache miss or an encoder change. It stores bytes and
checks that they hash to their digest (on put, and on every read from Redis); it does not
decode, validate or resize images. `scope` (an owner id) stores the bytes under
`scoped_digest(scope, digest)` instead, apart from every other owner's copy (for a gateway that
does not share encodes across API keys). Each store also carries the ownership index
(`owners`, `gateway.caching.ownership`) that says which owners sent which digests, with the
same lifetime as the bytes.

`MemoryImageStore` is an in-process LRU under a byte budget; `RedisImageStore` puts it in
front of Redis with a TTL (read-through with promotion, write-through), degrading to
memory-only, logged, when Redis fails.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from typing import Protocol, runtime_checkable

import structlog

from encoder_worker.storage import NAMESPACE, image_key, scoped_digest
from gateway.caching._lru import ByteLRU
from gateway.caching._redis_client import UNAVAILABLE, MemoryFrontedRedis
from gateway.caching.ownership import MemoryOwnerIndex, OwnerIndex, RedisOwnerIndex

__all__ = ("ImageStore", "MemoryImageStore", "RedisImageStore", "is_sha256_hex", "sha256_hex")

log = structlog.get_logger("visiongate.caching")

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# Hashing this much or more runs on a thread (hashlib releases the GIL) so the loop keeps serving.
_HASH_OFFLOAD_BYTES = 1 << 20


def is_sha256_hex(digest: str) -> bool:
    return isinstance(digest, str) and _SHA256_HEX.fullmatch(digest) is not None


async def sha256_hex(data: bytes) -> str:
    if len(data) < _HASH_OFFLOAD_BYTES:
        return hashlib.sha256(data).hexdigest()
    return await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())


def _stored_as(digest: str, scope: str | None) -> str:
    return digest if scope is None else scoped_digest(scope, digest)


async def _verified(digest: str, data: bytes) -> None:
    if not is_sha256_hex(digest):
        raise ValueError(f"digest must be 64 lowercase hex characters, got {digest!r:.80}")
    actual = await sha256_hex(data)
    if actual != digest:
        raise ValueError(f"image bytes hash to {actual}, not to the given digest {digest}")


@runtime_checkable
class ImageStore(Protocol):
    owners: OwnerIndex  # who sent which digests

    async def put(self, digest: str, data: bytes, *, scope: str | None = None) -> None:
        """Store the bytes; ValueError if sha256(data) is not `digest`."""

    async def get(self, digest: str, *, scope: str | None = None) -> bytes | None:
        """The stored bytes, or None."""

    async def contains(self, digest: str, *, scope: str | None = None) -> bool: ...

    async def aclose(self) -> None: ...


class MemoryImageStore:
    """In-process LRU under `max_bytes`; an image larger than the budget is not stored."""

    __slots__ = ("_lru", "owners")

    def __init__(self, max_bytes: int, owners: MemoryOwnerIndex | None = None) -> None:
        self._lru = ByteLRU(max_bytes)
        self.owners = owners or MemoryOwnerIndex()

    @property
    def max_bytes(self) -> int:
        return self._lru.max_bytes

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    @property
    def evictions(self) -> int:
        return self._lru.evictions

    def __len__(self) -> int:
        return len(self._lru)

    async def put(self, digest: str, data: bytes, *, scope: str | None = None) -> None:
        await _verified(digest, data)
        self._store(_stored_as(digest, scope), data)

    async def get(self, digest: str, *, scope: str | None = None) -> bytes | None:
        return self._lru.get(_stored_as(digest, scope))

    async def contains(self, digest: str, *, scope: str | None = None) -> bool:
        return _stored_as(digest, scope) in self._lru

    async def aclose(self) -> None:
        self._lru.clear()
        await self.owners.aclose()

    def _store(self, name: str, data: bytes) -> None:
        """Store bytes already verified, under the name they are stored as."""
        self._lru.put(name, data)


class RedisImageStore(MemoryFrontedRedis):
    """`memory` in front of Redis: key `{namespace}:image:{digest}` holding the raw bytes, TTL
    `ttl_s` (the key layout is `encoder_worker.storage`'s; encoder workers read these keys).

    get: memory, then Redis (GETEX, restarting the TTL); bytes from Redis are re-hashed and a
    mismatch is logged and treated as a miss; a hit is promoted into memory. contains: memory,
    then Redis EXISTS. put: memory and Redis (SET with PX). The ownership index (`owners`) is
    the memory one in front of Redis, on the same connection and TTL.
    """

    __slots__ = ("owners",)
    memory: MemoryImageStore

    def __init__(
        self,
        memory: MemoryImageStore,
        redis_url: str,
        ttl_s: float,
        namespace: str = NAMESPACE,
        *,
        retry_after_s: float = 5.0,
    ) -> None:
        super().__init__(
            memory, redis_url, ttl_s, namespace, tier="images", retry_after_s=retry_after_s
        )
        self.owners = RedisOwnerIndex(memory.owners, self._redis, ttl_s, namespace)

    @property
    def redis_errors(self) -> int:
        return self._redis.errors

    def key(self, digest: str) -> str:
        return image_key(digest, self.namespace)

    async def put(self, digest: str, data: bytes, *, scope: str | None = None) -> None:
        await _verified(digest, data)
        data = bytes(data)
        name = _stored_as(digest, scope)
        self.memory._store(name, data)
        key = self.key(name)
        await self._redis.call("put", lambda r: r.set(key, data, px=self._ttl_ms))

    async def get(self, digest: str, *, scope: str | None = None) -> bytes | None:
        data = await self.memory.get(digest, scope=scope)
        if data is not None or not is_sha256_hex(digest):
            return data
        name = _stored_as(digest, scope)
        key = self.key(name)
        raw = await self._redis.call("get", lambda r: r.getex(key, px=self._ttl_ms))
        if raw is UNAVAILABLE or raw is None:
            return None
        if await sha256_hex(raw) != digest:
            log.error("image_store_redis_value_corrupt", key=key, error="sha256 mismatch")
            return None
        self.memory._store(name, raw)
        return raw

    async def contains(self, digest: str, *, scope: str | None = None) -> bool:
        if await self.memory.contains(digest, scope=scope):
            return True
        if not is_sha256_hex(digest):
            return False
        key = self.key(_stored_as(digest, scope))
        found = await self._redis.call("contains", lambda r: r.exists(key))
        return found is not UNAVAILABLE and bool(found)

    async def aclose(self) -> None:
        await self._redis.aclose()
        await self.memory.aclose()
