"""VisionCache contract, run on MemoryVisionCache and on TieredVisionCache over a real Redis."""

from __future__ import annotations

import asyncio
import os
import time
import zlib

import msgspec
import pytest
from structlog.testing import capture_logs

from gateway.caching import (
    CacheHit,
    MemoryVisionCache,
    TieredVisionCache,
    VisionCache,
    VisionCacheStats,
    make_vision_cache,
)
from tests.gateway.caching.conftest import sha

FP = "siglip-so400m:p14:keep0.5:int4g64"
FP2 = "siglip-so400m:p14:keep0.3:int4g64"
D1, D2, D3, D4 = (sha(bytes([i])) for i in range(4))


def memory_of(cache: VisionCache) -> MemoryVisionCache:
    return cache if isinstance(cache, MemoryVisionCache) else cache.memory  # type: ignore[attr-defined]


@pytest.fixture(params=["memory", "tiered"])
async def make_cache(request: pytest.FixtureRequest):
    url = request.getfixturevalue("redis_url") if request.param == "tiered" else None
    made: list[VisionCache] = []

    def make(memory_bytes: int = 1 << 20, ttl_s: float = 60.0) -> VisionCache:
        memory = MemoryVisionCache(memory_bytes)
        cache = memory if url is None else TieredVisionCache(memory, url, ttl_s)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        await cache.aclose()


# -- contract: every backend ------------------------------------------------------------------


async def test_round_trip(make_cache) -> None:
    cache = make_cache()
    payload = os.urandom(1000)
    await cache.put(FP, D1, payload)
    hit = await cache.get(FP, D1)
    assert hit == CacheHit(payload, "memory")
    stats = await cache.stats()
    assert isinstance(stats, VisionCacheStats)
    assert (stats.entries, stats.bytes, stats.memory_hits) == (1, 1000, 1)
    assert isinstance(cache, VisionCache)


async def test_miss(make_cache) -> None:
    cache = make_cache()
    assert await cache.get(FP, D1) is None
    stats = await cache.stats()
    assert stats.memory_misses == 1 and stats.memory_hits == 0
    assert stats.redis_misses == (1 if isinstance(cache, TieredVisionCache) else 0)


async def test_fingerprint_isolation(make_cache) -> None:
    cache = make_cache()
    await cache.put(FP, D1, b"tokens from config A")
    assert await cache.get(FP2, D1) is None
    assert await cache.get(FP, D2) is None
    await cache.put(FP2, D1, b"tokens from config B")
    assert (await cache.get(FP, D1)).payload == b"tokens from config A"
    assert (await cache.get(FP2, D1)).payload == b"tokens from config B"


async def test_last_write_wins(make_cache) -> None:
    cache = make_cache()
    await cache.put(FP, D1, b"old")
    await cache.put(FP, D1, b"newer")
    assert (await cache.get(FP, D1)).payload == b"newer"
    assert (await cache.stats()).bytes == 5


async def test_lru_eviction_under_budget(make_cache) -> None:
    cache = make_cache(memory_bytes=300)
    payloads = {d: os.urandom(100) for d in (D1, D2, D3, D4)}
    for d in (D1, D2, D3):
        await cache.put(FP, d, payloads[d])
    assert (await cache.get(FP, D1)).tier == "memory"  # D1 is now the most recently used
    await cache.put(FP, D4, payloads[D4])  # evicts D2, the least recently used
    stats = await cache.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (3, 300, 1)
    memory = memory_of(cache)
    assert (FP, D2) not in memory and all((FP, d) in memory for d in (D1, D3, D4))
    hit = await cache.get(FP, D2)
    if isinstance(cache, TieredVisionCache):
        assert hit == CacheHit(payloads[D2], "redis")  # still in Redis, promoted back
        assert (FP, D2) in memory
    else:
        assert hit is None


async def test_entry_larger_than_budget_is_not_kept_in_memory(make_cache) -> None:
    cache = make_cache(memory_bytes=100)
    await cache.put(FP, D1, b"x" * 60)
    await cache.put(FP, D2, b"y" * 101)
    assert (FP, D2) not in memory_of(cache)
    assert (FP, D1) in memory_of(cache)  # nothing was evicted to make room
    stats = await cache.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (1, 60, 0)


async def test_bytes_like_payload_is_copied(make_cache) -> None:
    cache = make_cache()
    buf = bytearray(b"abc")
    await cache.put(FP, D1, buf)
    buf[0] = ord("z")
    hit = await cache.get(FP, D1)
    assert type(hit.payload) is bytes and hit.payload == b"abc"


async def test_malformed_keys(make_cache) -> None:
    cache = make_cache()
    with pytest.raises(ValueError):
        await cache.put(FP, "not-a-digest", b"x")
    with pytest.raises(ValueError):
        await cache.put(FP, D1.upper(), b"x")
    with pytest.raises(ValueError):
        await cache.put("", D1, b"x")
    assert await cache.get(FP, "*") is None


async def test_stats_encode_to_json(make_cache) -> None:
    cache = make_cache()
    await cache.put(FP, D1, b"abc")
    assert msgspec.json.decode(msgspec.json.encode(await cache.stats()))["entries"] == 1


# -- the Redis tier ---------------------------------------------------------------------------


@pytest.fixture
async def tiered(redis_url: str):
    made: list[TieredVisionCache] = []

    def make(memory_bytes: int = 1 << 20, ttl_s: float = 60.0, **kw) -> TieredVisionCache:
        cache = TieredVisionCache(
            MemoryVisionCache(memory_bytes), kw.pop("url", redis_url), ttl_s, **kw
        )
        made.append(cache)
        return cache

    yield make
    for cache in made:
        await cache.aclose()


async def test_redis_key_layout_and_ttl(tiered, raw_redis) -> None:
    await tiered(ttl_s=30).put(FP, D1, b"tokens")
    key = f"vg:vision:{FP}:{D1}"
    assert raw_redis.exists(key)
    assert 25_000 < raw_redis.pttl(key) <= 30_000
    await tiered(namespace="blue").put(FP, D2, b"tokens")
    assert raw_redis.exists(f"blue:vision:{FP}:{D2}")
    assert await tiered(namespace="green").get(FP, D2) is None


async def test_promotion_from_redis_to_memory(tiered) -> None:
    writer, reader = tiered(), tiered()
    await writer.put(FP, D1, b"shared tokens")
    assert await reader.get(FP, D1) == CacheHit(b"shared tokens", "redis")
    assert await reader.get(FP, D1) == CacheHit(b"shared tokens", "memory")
    stats = await reader.stats()
    assert (stats.redis_hits, stats.memory_hits, stats.memory_misses, stats.entries) == (1, 1, 1, 1)


async def test_survives_restart(tiered) -> None:
    before = tiered()
    await before.put(FP, D1, b"tokens")
    await before.aclose()
    assert await tiered().get(FP, D1) == CacheHit(b"tokens", "redis")


async def test_ttl_expiry(tiered, raw_redis) -> None:
    await tiered(ttl_s=0.3).put(FP, D1, b"tokens")
    await asyncio.sleep(0.45)
    assert not raw_redis.exists(f"vg:vision:{FP}:{D1}")
    assert await tiered().get(FP, D1) is None


async def test_read_restarts_ttl(tiered, raw_redis) -> None:
    await tiered(ttl_s=30).put(FP, D1, b"tokens")
    key = f"vg:vision:{FP}:{D1}"
    raw_redis.pexpire(key, 1000)
    assert (await tiered(ttl_s=30).get(FP, D1)).tier == "redis"
    assert raw_redis.pttl(key) > 25_000


async def test_corrupted_redis_values_miss(tiered, raw_redis) -> None:
    key = f"vg:vision:{FP}:{D1}"
    raw_redis.set(key, b"\xc1 not msgpack")
    with capture_logs() as logs:
        assert await tiered().get(FP, D1) is None
    assert [e["event"] for e in logs] == ["vision_cache_redis_value_corrupt"]
    assert logs[0]["log_level"] == "error"

    raw_redis.set(key, msgspec.msgpack.encode([zlib.crc32(b"tokens"), b"tokenz"]))  # bit rot
    with capture_logs() as logs:
        cache = tiered()
        assert await cache.get(FP, D1) is None
    assert "checksum" in logs[0]["error"]
    assert (await cache.stats()).redis_misses == 1

    await cache.put(FP, D1, b"tokens")  # the next encode repairs it
    assert await tiered().get(FP, D1) == CacheHit(b"tokens", "redis")


async def test_dead_redis_degrades_to_memory(tiered, dead_redis_url: str) -> None:
    cache = tiered(url=dead_redis_url)
    started = time.monotonic()
    with capture_logs() as logs:
        await cache.put(FP, D1, b"tokens")
        assert await cache.get(FP, D1) == CacheHit(b"tokens", "memory")
        assert await cache.get(FP, D2) is None
        await cache.put(FP, D2, b"more")
    assert time.monotonic() - started < 2.0
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [e["event"] for e in warnings] == ["redis_unavailable"]  # once per outage
    assert warnings[0]["tier"] == "vision"
    stats = await cache.stats()
    assert stats.redis_errors == 1  # later calls skip Redis while it is down
    assert stats.entries == 2


async def test_redis_outage_and_recovery(redis_process) -> None:
    cache = TieredVisionCache(MemoryVisionCache(1 << 20), redis_process.url, 60, retry_after_s=0.05)
    other = TieredVisionCache(MemoryVisionCache(1 << 20), redis_process.url, 60)
    try:
        await cache.put(FP, D1, b"before")
        redis_process.stop()
        with capture_logs() as logs:
            assert await cache.get(FP, D2) is None
            await cache.put(FP, D2, b"during")
            assert (await cache.get(FP, D2)).payload == b"during"  # memory keeps serving
            redis_process.start()
            await asyncio.sleep(0.1)
            await cache.put(FP, D3, b"after")
        events = [e["event"] for e in logs]
        assert events[0] == "redis_unavailable" and events[-1] == "redis_recovered"
        assert await other.get(FP, D3) == CacheHit(b"after", "redis")
    finally:
        await cache.aclose()
        await other.aclose()


async def test_factory() -> None:
    cache = make_vision_cache(None, 1024, 60)
    assert isinstance(cache, MemoryVisionCache) and cache.max_bytes == 1024
    tiered_cache = make_vision_cache("redis://127.0.0.1:1/0", 2048, 60)
    assert isinstance(tiered_cache, TieredVisionCache) and tiered_cache.memory.max_bytes == 2048
    await tiered_cache.aclose()
