"""The image store: original image bytes by sha256 digest.

It lets a client refer to an uploaded image later (`visiongate:sha256:<hex>`) and lets the
gateway re-encode an image after a vision-cache miss or an encoder change. It stores bytes and
checks that they hash to their digest (on put, and on every read from Redis); it does not
decode, validate or resize images.

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

from encoder_worker.storage import NAMESPACE, image_key
from gateway.caching._lru import ByteLRU
from gateway.caching._redis_client import UNAVAILABLE, RedisTier

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


async def _verified(digest: str, data: bytes) -> None:
    if not is_sha256_hex(digest):
        raise ValueError(f"digest must be 64 lowercase hex characters, got {digest!r:.80}")
    actual = await sha256_hex(data)
    if actual != digest:
        raise ValueError(f"image bytes hash to {actual}, not to the given digest {digest}")


@runtime_checkable
class ImageStore(Protocol):
    async def put(self, digest: str, data: bytes) -> None:
        """Store the bytes; ValueError if sha256(data) is not `digest`."""

    async def get(self, digest: str) -> bytes | None:
        """The stored bytes, or None."""

    async def contains(self, digest: str) -> bool: ...

    async def aclose(self) -> None: ...


class MemoryImageStore:
    """In-process LRU under `max_bytes`; an image larger than the budget is not stored."""

    __slots__ = ("_lru",)

    def __init__(self, max_bytes: int) -> None:
        self._lru = ByteLRU(max_bytes)

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

    async def put(self, digest: str, data: bytes) -> None:
        await _verified(digest, data)
        self._store(digest, data)

    async def get(self, digest: str) -> bytes | None:
        return self._lru.get(digest)

    async def contains(self, digest: str) -> bool:
        return digest in self._lru

    async def aclose(self) -> None:
        self._lru.clear()

    def _store(self, digest: str, data: bytes) -> None:
        """Store bytes already verified against `digest`."""
        self._lru.put(digest, data)


class RedisImageStore:
    """`memory` in front of Redis: key `{namespace}:image:{digest}` holding the raw bytes, TTL
    `ttl_s` (the key layout is `encoder_worker.storage`'s; encoder workers read these keys).

    get: memory, then Redis (GETEX, restarting the TTL); bytes from Redis are re-hashed and a
    mismatch is logged and treated as a miss; a hit is promoted into memory. contains: memory,
    then Redis EXISTS. put: memory and Redis (SET with PX).
    """

    __slots__ = ("_redis", "_ttl_ms", "memory", "namespace", "ttl_s")

    def __init__(
        self,
        memory: MemoryImageStore,
        redis_url: str,
        ttl_s: float,
        namespace: str = NAMESPACE,
        *,
        retry_after_s: float = 5.0,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.memory = memory
        self.ttl_s = ttl_s
        self.namespace = namespace
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._redis = RedisTier(redis_url, tier="images", retry_after_s=retry_after_s)

    @property
    def redis_errors(self) -> int:
        return self._redis.errors

    def key(self, digest: str) -> str:
        return image_key(digest, self.namespace)

    async def put(self, digest: str, data: bytes) -> None:
        await _verified(digest, data)
        data = bytes(data)
        self.memory._store(digest, data)
        key = self.key(digest)
        await self._redis.call("put", lambda r: r.set(key, data, px=self._ttl_ms))

    async def get(self, digest: str) -> bytes | None:
        data = await self.memory.get(digest)
        if data is not None or not is_sha256_hex(digest):
            return data
        key = self.key(digest)
        raw = await self._redis.call("get", lambda r: r.getex(key, px=self._ttl_ms))
        if raw is UNAVAILABLE or raw is None:
            return None
        if await sha256_hex(raw) != digest:
            log.error("image_store_redis_value_corrupt", key=key, error="sha256 mismatch")
            return None
        self.memory._store(digest, raw)
        return raw

    async def contains(self, digest: str) -> bool:
        if await self.memory.contains(digest):
            return True
        if not is_sha256_hex(digest):
            return False
        key = self.key(digest)
        found = await self._redis.call("contains", lambda r: r.exists(key))
        return found is not UNAVAILABLE and bool(found)

    async def aclose(self) -> None:
        await self._redis.aclose()
        await self.memory.aclose()
