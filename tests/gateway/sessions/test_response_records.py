"""The response-record store (`gateway.sessions.response_records`) on memory and on a real
redis-server: one contract for both (owner-scoped reads and deletes), the memory store's idle
expiry and byte budget, and the Redis records' TTL and corrupt entries."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gateway.sessions.response_records import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseRecord,
    ResponseStore,
)


@pytest.fixture(params=["memory", "redis"])
async def response_store(request: pytest.FixtureRequest) -> Any:
    if request.param == "memory":
        store: ResponseStore = MemoryResponseStore(60.0)
    else:
        store = RedisResponseStore(request.getfixturevalue("redis_url"), 60.0)
    yield store
    await store.aclose()


def record(owner: str = "alice", response_id: str = "resp_1") -> ResponseRecord:
    return ResponseRecord(
        id=response_id,
        owner=owner,
        created_at=1.0,
        body=b'{"id": "resp_1"}',
        session_id="sess_1",
        last_item_id="msg_1",
    )


async def test_record_store_contract(response_store: ResponseStore) -> None:
    assert isinstance(response_store, ResponseStore)
    assert await response_store.get("resp_1", "alice") is None
    await response_store.put(record())
    assert await response_store.get("resp_1", "alice") == record()
    assert await response_store.get("resp_1", "bob") is None  # owner-scoped
    assert not await response_store.delete("resp_1", "bob")
    await response_store.put(record(owner="bob"))  # the same id under another key: its own
    assert await response_store.delete("resp_1", "alice")
    assert await response_store.get("resp_1", "alice") is None
    assert (await response_store.get("resp_1", "bob")).owner == "bob"
    assert not await response_store.delete("resp_1", "alice")


async def test_memory_records_expire_when_idle() -> None:
    now = [0.0]
    store = MemoryResponseStore(10.0, clock=lambda: now[0])
    await store.put(record())
    now[0] = 8.0
    assert await store.get("resp_1", "alice") is not None  # reading refreshes it
    now[0] = 17.0
    assert await store.get("resp_1", "alice") is not None
    now[0] = 28.0
    assert await store.get("resp_1", "alice") is None


async def test_memory_records_stay_within_their_byte_budget() -> None:
    size = len(msgspec.msgpack.encode(record()))
    store = MemoryResponseStore(60.0, max_bytes=size * 3)
    for i in range(5):
        await store.put(record(response_id=f"resp_{i}"))
        if i == 2:
            assert await store.get("resp_0", "alice") is not None  # read: now the most recent
    # the least recently used went first; the budget holds
    kept = [i for i in range(5) if await store.get(f"resp_{i}", "alice") is not None]
    assert kept == [0, 3, 4]
    assert store._bytes <= size * 3


async def test_redis_records_have_the_session_ttl(redis_url: str, raw_redis: Any) -> None:
    store = RedisResponseStore(redis_url, 30.0)
    try:
        await store.put(record())
        key = "vg:response:alice:resp_1"
        assert 0 < raw_redis.pttl(key) <= 30_000
        raw_redis.set(key, b"not msgpack")
        assert await store.get("resp_1", "alice") is None  # corrupt reads as unknown
    finally:
        await store.aclose()
