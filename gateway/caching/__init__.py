"""Content-addressed caches: visual tokens (`VisionCache`), original images (`ImageStore`, with
the `OwnerIndex` of which API keys sent which images), and single-flight for work that fills
them.

Each has an in-process implementation (the embedded default) and a Redis-backed one for
scale-out; Redis is imported only when a Redis-backed one is made.
"""

from __future__ import annotations

from gateway.caching.image_store import (
    ImageStore,
    MemoryImageStore,
    RedisImageStore,
    is_sha256_hex,
    sha256_hex,
)
from gateway.caching.ownership import MemoryOwnerIndex, OwnerIndex, Ownership, RedisOwnerIndex
from gateway.caching.singleflight import SingleFlight
from gateway.caching.vision_cache import (
    CacheHit,
    MemoryVisionCache,
    TieredVisionCache,
    VisionCache,
    VisionCacheStats,
)

__all__ = (
    "CacheHit",
    "ImageStore",
    "MemoryImageStore",
    "MemoryOwnerIndex",
    "MemoryVisionCache",
    "OwnerIndex",
    "Ownership",
    "RedisImageStore",
    "RedisOwnerIndex",
    "SingleFlight",
    "TieredVisionCache",
    "VisionCache",
    "VisionCacheStats",
    "is_sha256_hex",
    "make_image_store",
    "make_vision_cache",
    "sha256_hex",
)


def make_vision_cache(redis_url: str | None, memory_bytes: int, ttl_s: float) -> VisionCache:
    """Memory-only without a Redis URL; otherwise the memory LRU in front of Redis."""
    memory = MemoryVisionCache(memory_bytes)
    if redis_url is None:
        return memory
    return TieredVisionCache(memory, redis_url, ttl_s)


def make_image_store(redis_url: str | None, memory_bytes: int, ttl_s: float) -> ImageStore:
    """Memory-only without a Redis URL; otherwise the memory LRU in front of Redis."""
    memory = MemoryImageStore(memory_bytes)
    if redis_url is None:
        return memory
    return RedisImageStore(memory, redis_url, ttl_s)
