"""ImageStore contract, run on MemoryImageStore and on RedisImageStore over a real Redis."""

from __future__ import annotations

import asyncio
import os

import pytest
from structlog.testing import capture_logs

from gateway.caching import (
    ImageStore,
    MemoryImageStore,
    RedisImageStore,
    make_image_store,
)
from tests.gateway.caching.conftest import sha


def memory_of(store: ImageStore) -> MemoryImageStore:
    return store if isinstance(store, MemoryImageStore) else store.memory  # type: ignore[attr-defined]


def blob(n: int = 100) -> tuple[str, bytes]:
    data = os.urandom(n)
    return sha(data), data


@pytest.fixture(params=["memory", "redis"])
async def make_store(request: pytest.FixtureRequest):
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    made: list[ImageStore] = []

    def make(memory_bytes: int = 1 << 24, ttl_s: float = 60.0) -> ImageStore:
        memory = MemoryImageStore(memory_bytes)
        store = memory if url is None else RedisImageStore(memory, url, ttl_s)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.aclose()


# -- contract: every backend ------------------------------------------------------------------


async def test_round_trip_real_photo(make_store, astronaut_jpeg: bytes) -> None:
    store = make_store()
    digest = sha(astronaut_jpeg)
    assert isinstance(store, ImageStore)
    await store.put(digest, astronaut_jpeg)
    assert await store.contains(digest)
    assert await store.get(digest) == astronaut_jpeg


async def test_miss(make_store) -> None:
    store = make_store()
    digest, _ = blob()
    assert await store.get(digest) is None
    assert not await store.contains(digest)
    assert await store.get("../../etc/passwd") is None
    assert not await store.contains("*")


async def test_put_verifies_digest(make_store) -> None:
    store = make_store()
    digest, data = blob()
    other, _ = blob()
    with pytest.raises(ValueError, match="hash to"):
        await store.put(other, data)
    with pytest.raises(ValueError, match="64 lowercase hex"):
        await store.put(digest.upper(), data)
    with pytest.raises(ValueError):
        await store.put("sha256:" + digest, data)
    assert not await store.contains(other) and not await store.contains(digest)


async def test_put_verifies_large_images_too(make_store) -> None:
    store = make_store()
    digest, data = blob(3 << 20)  # hashed off the event loop
    with pytest.raises(ValueError):
        await store.put(sha(b"something else"), data)
    await store.put(digest, data)
    assert await store.get(digest) == data


async def test_lru_eviction_under_budget(make_store) -> None:
    store = make_store(memory_bytes=300)
    images = [blob() for _ in range(4)]
    for digest, data in images[:3]:
        await store.put(digest, data)
    assert await store.get(images[0][0]) == images[0][1]  # most recently used now
    await store.put(*images[3])
    memory = memory_of(store)
    assert (len(memory), memory.nbytes, memory.evictions) == (3, 300, 1)
    assert not await memory.contains(images[1][0])
    evicted = images[1]
    if isinstance(store, RedisImageStore):
        assert await store.contains(evicted[0])
        assert await store.get(evicted[0]) == evicted[1]  # promoted back from Redis
        assert await memory.contains(evicted[0])
    else:
        assert await store.get(evicted[0]) is None


async def test_image_larger_than_budget_is_not_kept_in_memory(make_store) -> None:
    store = make_store(memory_bytes=100)
    digest, data = blob(101)
    await store.put(digest, data)
    assert len(memory_of(store)) == 0


async def test_concurrent_puts_of_one_image(make_store) -> None:
    store = make_store()
    digest, data = blob()
    await asyncio.gather(*(store.put(digest, data) for _ in range(8)))
    assert await store.get(digest) == data
    assert len(memory_of(store)) == 1


# -- the Redis tier ---------------------------------------------------------------------------


@pytest.fixture
async def redis_store(redis_url: str):
    made: list[RedisImageStore] = []

    def make(
        memory_bytes: int = 1 << 24, ttl_s: float = 60.0, url: str | None = None, **kw
    ) -> RedisImageStore:
        store = RedisImageStore(MemoryImageStore(memory_bytes), url or redis_url, ttl_s, **kw)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.aclose()


async def test_redis_key_layout_and_ttl(redis_store, raw_redis) -> None:
    digest, data = blob()
    await redis_store(ttl_s=30).put(digest, data)
    assert raw_redis.get(f"vg:image:{digest}") == data
    assert 25_000 < raw_redis.pttl(f"vg:image:{digest}") <= 30_000


async def test_promotion_and_restart(redis_store) -> None:
    digest, data = blob()
    first = redis_store()
    await first.put(digest, data)
    await first.aclose()
    second = redis_store()
    assert await second.contains(digest)
    assert not await second.memory.contains(digest)  # contains does not promote
    assert await second.get(digest) == data
    assert await second.memory.contains(digest)


async def test_ttl_expiry(redis_store) -> None:
    digest, data = blob()
    await redis_store(ttl_s=0.3).put(digest, data)
    await asyncio.sleep(0.45)
    fresh = redis_store()
    assert not await fresh.contains(digest)
    assert await fresh.get(digest) is None


async def test_corrupted_redis_value_misses(redis_store, raw_redis) -> None:
    digest, data = blob()
    raw_redis.set(f"vg:image:{digest}", data[:-1] + b"!")
    store = redis_store()
    with capture_logs() as logs:
        assert await store.get(digest) is None
    assert [(e["event"], e["log_level"]) for e in logs] == [
        ("image_store_redis_value_corrupt", "error")
    ]
    assert not await store.memory.contains(digest)
    await store.put(digest, data)
    assert await redis_store().get(digest) == data


async def test_dead_redis_degrades_to_memory(redis_store, dead_redis_url: str) -> None:
    store = redis_store(url=dead_redis_url)
    digest, data = blob()
    missing, _ = blob()
    with capture_logs() as logs:
        await store.put(digest, data)
        assert await store.get(digest) == data
        assert await store.contains(digest)
        assert await store.get(missing) is None
        assert not await store.contains(missing)
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["redis_unavailable"]
    assert store.redis_errors == 1


async def test_factory() -> None:
    store = make_image_store(None, 1024, 60)
    assert isinstance(store, MemoryImageStore) and store.max_bytes == 1024
    redis_backed = make_image_store("redis://127.0.0.1:1/0", 2048, 60)
    assert isinstance(redis_backed, RedisImageStore) and redis_backed.memory.max_bytes == 2048
    await redis_backed.aclose()
