"""The vision cache: encoded visual tokens by (encoder fingerprint, image digest).

Content-addressed: the key is the encoder's fingerprint (weights, preprocessing, pruning and
quantization config) plus the sha256 hex digest of the image bytes, so a changed encoder config
misses instead of serving stale tokens. Values are opaque bytes (the encoder's packed payload);
the cache never interprets them. It does not know who may read an entry: the vision resolver
checks ownership before it asks, and names an entry `scoped_digest(owner, digest)` instead of
the digest when encodes are not shared across API keys.

Two implementations: `MemoryVisionCache`, an in-process LRU under a byte budget, and
`TieredVisionCache`, that LRU in front of Redis with a TTL (read-through with promotion,
write-through on put). Redis failures degrade to memory-only, logged, never raised.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import msgspec
import structlog

from encoder_worker.storage import NAMESPACE, read_redis_value, redis_value, vision_key
from gateway.caching._lru import ByteLRU
from gateway.caching._redis_client import UNAVAILABLE, MemoryFrontedRedis
from gateway.caching.image_store import is_sha256_hex

__all__ = ("CacheHit", "MemoryVisionCache", "TieredVisionCache", "VisionCache", "VisionCacheStats")

log = structlog.get_logger("visiongate.caching")

Tier = Literal["memory", "redis"]


class CacheHit(msgspec.Struct, frozen=True):
    payload: bytes
    tier: Tier  # where this lookup found it


class VisionCacheStats(msgspec.Struct, frozen=True, kw_only=True):
    entries: int  # in the memory tier
    bytes: int  # payload bytes in the memory tier
    max_bytes: int  # the memory tier's budget
    memory_hits: int = 0
    memory_misses: int = 0
    redis_hits: int = 0
    redis_misses: int = 0  # lookups that reached Redis and found nothing usable
    redis_errors: int = 0  # failed Redis calls (each one served from memory instead)
    evictions: int = 0  # memory-tier LRU evictions


@runtime_checkable
class VisionCache(Protocol):
    async def get(self, fingerprint: str, digest: str) -> CacheHit | None:
        """The payload stored for this encoder and image, or None."""

    async def put(self, fingerprint: str, digest: str, payload: bytes) -> None:
        """Store the payload (last write wins). Never raises for a backend failure."""

    async def stats(self) -> VisionCacheStats: ...

    async def aclose(self) -> None: ...


def _check_key(fingerprint: str, digest: str) -> None:
    if not fingerprint:
        raise ValueError("empty encoder fingerprint")
    if not is_sha256_hex(digest):
        raise ValueError(f"digest must be 64 lowercase hex characters, got {digest!r:.80}")


class MemoryVisionCache:
    """In-process LRU under `max_bytes` of payload; an entry over the budget is not stored."""

    __slots__ = ("_hits", "_lru", "_misses")

    def __init__(self, max_bytes: int) -> None:
        self._lru = ByteLRU(max_bytes)
        self._hits = 0
        self._misses = 0

    @property
    def max_bytes(self) -> int:
        return self._lru.max_bytes

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._lru

    async def get(self, fingerprint: str, digest: str) -> CacheHit | None:
        payload = self._lru.get((fingerprint, digest))
        if payload is None:
            self._misses += 1
            return None
        self._hits += 1
        return CacheHit(payload, "memory")

    async def put(self, fingerprint: str, digest: str, payload: bytes) -> None:
        _check_key(fingerprint, digest)
        self._lru.put((fingerprint, digest), payload)

    async def stats(self) -> VisionCacheStats:
        return VisionCacheStats(
            entries=len(self._lru),
            bytes=self._lru.nbytes,
            max_bytes=self._lru.max_bytes,
            memory_hits=self._hits,
            memory_misses=self._misses,
            evictions=self._lru.evictions,
        )

    async def aclose(self) -> None:
        self._lru.clear()


class TieredVisionCache(MemoryFrontedRedis):
    """`memory` in front of Redis: key `{namespace}:vision:{fingerprint}:{digest}`, TTL `ttl_s`
    (`encoder_worker.storage` holds the key layout and the value's framing, which encoder
    workers write too).

    get: memory, then Redis (GETEX, which also restarts the entry's TTL, so images in use stay
    cached); a Redis hit is promoted into memory. put: memory and Redis (SET with PX). A Redis
    value that fails its checksum or does not decode is logged and treated as a miss. Needs
    Redis >= 6.2 (GETEX).
    """

    __slots__ = ("_hits", "_misses")
    memory: MemoryVisionCache

    def __init__(
        self,
        memory: MemoryVisionCache,
        redis_url: str,
        ttl_s: float,
        namespace: str = NAMESPACE,
        *,
        retry_after_s: float = 5.0,
    ) -> None:
        super().__init__(
            memory, redis_url, ttl_s, namespace, tier="vision", retry_after_s=retry_after_s
        )
        self._hits = 0
        self._misses = 0

    def key(self, fingerprint: str, digest: str) -> str:
        return vision_key(fingerprint, digest, self.namespace)

    async def get(self, fingerprint: str, digest: str) -> CacheHit | None:
        hit = await self.memory.get(fingerprint, digest)
        if hit is not None:
            return hit
        if not fingerprint or not is_sha256_hex(digest):
            return None
        key = self.key(fingerprint, digest)
        raw = await self._redis.call("get", lambda r: r.getex(key, px=self._ttl_ms))
        if raw is UNAVAILABLE:
            return None
        if raw is None:
            self._misses += 1
            return None
        payload = self._unpack(key, raw)
        if payload is None:
            self._misses += 1
            return None
        self._hits += 1
        await self.memory.put(fingerprint, digest, payload)
        return CacheHit(payload, "redis")

    async def put(self, fingerprint: str, digest: str, payload: bytes) -> None:
        await self.memory.put(fingerprint, digest, payload)  # validates the key
        value = redis_value(payload)
        key = self.key(fingerprint, digest)
        await self._redis.call("put", lambda r: r.set(key, value, px=self._ttl_ms))

    async def stats(self) -> VisionCacheStats:
        mem = await self.memory.stats()
        return msgspec.structs.replace(
            mem, redis_hits=self._hits, redis_misses=self._misses, redis_errors=self._redis.errors
        )

    async def aclose(self) -> None:
        await self._redis.aclose()
        await self.memory.aclose()

    @staticmethod
    def _unpack(key: str, raw: bytes) -> bytes | None:
        try:
            return read_redis_value(raw)
        except ValueError as exc:
            log.error("vision_cache_redis_value_corrupt", key=key, error=str(exc))
            return None
