"""KVStore contract: the same suite on the memory store and on Redis (a real redis-server)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
import torch
from structlog.testing import capture_logs

from gateway.engine.local.kv.blocks import (
    KVEntry,
    block_hashes,
    chain_seed,
    common_prefix,
    position_keys,
)
from gateway.engine.local.kv.redis_store import RedisKVStore, decode_entry, encode_entry
from gateway.engine.local.kv.store import KVStore, MemoryKVStore
from gateway.engine.local.prompt import ImageSpan

SEED = chain_seed("test-model", "float32", 4)
LAYERS, HEADS, DIM = 2, 1, 4
PER_TOKEN = LAYERS * 2 * HEADS * DIM * 4  # bytes per position


def make_entry(tokens: list[int], images: list[ImageSpan] = (), fill: float = 1.0) -> KVEntry:
    n = len(tokens)
    layers = [
        (
            torch.full((1, HEADS, n, DIM), float(fill + i), dtype=torch.float32),
            torch.arange(n * DIM, dtype=torch.float32).reshape(1, HEADS, n, DIM),
        )
        for i in range(LAYERS)
    ]
    return KVEntry(list(tokens), list(images), 4, block_hashes(tokens, images, 4, SEED), layers)


def same(a: KVEntry, b: KVEntry) -> bool:
    return (
        a.tokens == b.tokens
        and a.images == b.images
        and a.hashes == b.hashes
        and all(
            torch.equal(x, y)
            for pa, pb in zip(a.layers, b.layers, strict=False)
            for x, y in zip(pa, pb, strict=False)
        )
    )


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_store(backend: str, request: pytest.FixtureRequest) -> Iterator:
    stores: list[KVStore] = []

    def make(budget: int = 1 << 20, ttl_s: int = 3600) -> KVStore:
        if backend == "memory":
            store: KVStore = MemoryKVStore(budget)
        else:
            url = request.getfixturevalue("redis_url")
            store = RedisKVStore(url, seed=SEED, ttl_s=ttl_s)  # no memory tier: no budget
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def test_put_get_replace_delete(make_store) -> None:
    store = make_store()
    assert isinstance(store, KVStore)
    assert store.get("s1") is None
    first = make_entry(list(range(10)))
    store.put("s1", first)
    assert same(store.get("s1"), first)
    second = make_entry(list(range(12)), fill=5.0)
    store.put("s1", second)
    assert same(store.get("s1"), second)
    store.delete("s1")
    store.flush(5)
    assert store.get("s1") is None


def test_hash_mismatch_is_a_miss(make_store) -> None:
    store = make_store()
    store.put("s1", make_entry(list(range(10))))
    other = list(range(100, 110))
    assert store.get("s1", block_hashes(other, [], 4, SEED)) is None
    same_start = [*list(range(8)), 99, 98]
    assert store.get("s1", block_hashes(same_start, [], 4, SEED)) is not None


def test_memory_store_evicts_least_recently_used_under_its_budget() -> None:
    store = MemoryKVStore(PER_TOKEN * 25)  # room for two 10-token entries, not three
    entries = {key: make_entry(list(range(10)), fill=i) for i, key in enumerate(["a", "b", "c"])}
    store.put("a", entries["a"])
    store.put("b", entries["b"])
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", entries["c"])
    assert store.nbytes <= PER_TOKEN * 25
    assert "b" not in store and "a" in store and "c" in store
    assert store.get("b") is None


def test_memory_store_keeps_no_entry_larger_than_its_budget() -> None:
    store = MemoryKVStore(PER_TOKEN * 5)
    store.put("big", make_entry(list(range(10))))
    assert "big" not in store and store.nbytes == 0


def test_common_prefix_stops_at_changed_image() -> None:
    a_imgs = [ImageSpan(5, 6, "digest-a:1")]
    b_imgs = [ImageSpan(5, 6, "digest-b:1")]
    tokens = [1, 2, 3, 4, 5] + [-1] * 6 + [7, 8, 9, 10, 11]
    ha, hb = block_hashes(tokens, a_imgs, 4, SEED), block_hashes(tokens, b_imgs, 4, SEED)
    assert ha[0] == hb[0] and ha[1] != hb[1]
    n = common_prefix(ha, position_keys(tokens, a_imgs), hb, position_keys(tokens, b_imgs), 4)
    assert n == 5
    assert (
        common_prefix(ha, position_keys(tokens, a_imgs), ha, position_keys(tokens, a_imgs), 4) == 16
    )


def test_codec_round_trip_and_seed_check() -> None:
    entry = make_entry([1, 2, 3, -1, -1, 6], [ImageSpan(3, 2, "d:1")])
    raw = encode_entry(entry, SEED)
    assert same(decode_entry(raw, SEED), entry)
    with pytest.raises(ValueError):
        decode_entry(raw, chain_seed("other-model", "float32", 4))


# -- Redis only ----------------------------------------------------------------------------


def test_redis_spill_and_reload_in_another_store(redis_url: str) -> None:
    writer = RedisKVStore(redis_url, seed=SEED)
    entry = make_entry(list(range(9)))
    writer.put("s1", entry)
    assert writer.flush(5)
    reader = RedisKVStore(redis_url, seed=SEED)  # another replica
    try:
        assert same(reader.get("s1"), entry)
    finally:
        writer.close()
        reader.close()


def test_redis_store_keeps_no_kv_in_the_process(redis_url: str, raw_redis) -> None:
    """The engine's prefix cache is the memory tier: once written, an entry is read from Redis
    alone, so one deleted there (or expired) is a miss, never an answer from a local copy."""
    store = RedisKVStore(redis_url, seed=SEED)
    try:
        entry = make_entry(list(range(9)))
        store.put("s1", entry)
        assert store.flush(5)
        assert same(store.get("s1"), entry)
        raw_redis.delete(store.redis_key("s1"))
        assert store.get("s1") is None
    finally:
        store.close()


def test_redis_ttl(redis_url: str) -> None:
    store = RedisKVStore(redis_url, seed=SEED, ttl_s=1)
    try:
        store.put("s1", make_entry(list(range(9))))
        assert store.flush(5)
        client = redis.Redis.from_url(redis_url)
        assert 0 < client.ttl(store.redis_key("s1")) <= 1
        time.sleep(1.5)
        assert store.get("s1") is None
        client.close()
    finally:
        store.close()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda raw: b"garbage",
        lambda raw: raw[:-3],  # truncated body
        lambda raw: raw[:8] + b"\xff" * 10 + raw[18:],  # header bytes smashed
        lambda raw: raw[:-4] + b"\x00\x00\x80\x7f",  # one tensor value changed
    ],
    ids=["garbage", "truncated", "bad-header", "body-bits"],
)
def test_redis_corrupt_value_is_a_miss(redis_url: str, corrupt) -> None:
    store = RedisKVStore(redis_url, seed=SEED)
    try:
        entry = make_entry(list(range(9)))
        raw = encode_entry(entry, SEED)
        client = redis.Redis.from_url(redis_url)
        client.set(store.redis_key("s1"), corrupt(raw))
        client.close()
        with capture_logs() as logs:
            assert store.get("s1") is None  # never raises
        assert any(line["event"] == "kv.redis_corrupt" for line in logs)
    finally:
        store.close()


def test_redis_token_tampering_detected_by_hashes(redis_url: str) -> None:
    store = RedisKVStore(redis_url, seed=SEED)
    try:
        raw = bytearray(encode_entry(make_entry([11, 12, 13, 14, 15, 16, 17, 18, 19]), SEED))
        at = raw.index(bytes([11, 12, 13]))  # msgpack positive fixints
        raw[at] = 42
        client = redis.Redis.from_url(redis_url)
        client.set(store.redis_key("s1"), bytes(raw))
        client.close()
        assert store.get("s1") is None
    finally:
        store.close()


def test_redis_unreachable_is_a_miss() -> None:
    from tests.conftest import free_port

    store = RedisKVStore(f"redis://127.0.0.1:{free_port()}/0", seed=SEED, socket_timeout_s=0.5)
    try:
        assert store.get("s1") is None
        with capture_logs() as logs:
            store.put("s1", make_entry(list(range(9))))  # the write fails quietly
            assert store.flush(5)
        assert any(line["event"] == "kv.redis_write_failed" for line in logs)
        assert store.get("s1") is None
    finally:
        store.close()
