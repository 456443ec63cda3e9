"""SessionStore contract, run on MemorySessionStore and on RedisSessionStore over a real Redis."""

from __future__ import annotations

import asyncio
import time
import zlib

import msgspec
import pytest
from redis.crc import key_slot
from structlog.testing import capture_logs

from gateway.protocol.errors import GatewayError
from gateway.sessions import (
    MemorySessionStore,
    RedisSessionStore,
    Session,
    SessionStore,
    StoredItem,
    StoredPart,
    make_session_store,
)
from gateway.sessions.redis import BUCKETS
from tests.conftest import free_port

ALICE, BOB = "key_alice", "key_bob"
DIGEST = "ab" * 32


def conversation(owner: str = ALICE) -> Session:
    session = Session.new(owner, instructions="Be brief.", max_output_tokens=64)
    session.items.append(
        StoredItem(
            id="item_1",
            role="user",
            parts=[
                StoredPart("image", digest=DIGEST),
                StoredPart("text", text="What is in the photo?"),
            ],
        )
    )
    session.items.append(
        StoredItem(
            id="item_2",
            role="assistant",
            response_id="resp_1",
            parts=[StoredPart("text", text="An astronaut.")],
        )
    )
    return session


@pytest.fixture(params=["memory", "redis"])
async def make_store(request: pytest.FixtureRequest):
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    made: list[SessionStore] = []

    def make(ttl_s: float = 60.0) -> SessionStore:
        store = MemorySessionStore(ttl_s) if url is None else RedisSessionStore(url, ttl_s)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.aclose()


async def expect_not_found(store: SessionStore, session_id: str, owner: str) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        await store.load(session_id, owner)
    assert info.value.code == "session_not_found" and info.value.http_status == 404
    return info.value


# -- contract: every backend ------------------------------------------------------------------


async def test_round_trip(make_store) -> None:
    store = make_store()
    assert isinstance(store, SessionStore)
    session = conversation()
    await store.save(session)
    loaded = await store.load(session.id, ALICE)
    assert loaded == session
    assert loaded.image_digests == [DIGEST]
    assert loaded is not session


async def test_unknown_id_is_not_found(make_store) -> None:
    await expect_not_found(make_store(), "sess_missing", ALICE)


async def test_foreign_owner_is_the_same_error_as_unknown(make_store) -> None:
    store = make_store()
    session = conversation()
    await store.save(session)
    foreign = await expect_not_found(store, session.id, BOB)
    await store.delete(session.id, ALICE)
    unknown = await expect_not_found(store, session.id, ALICE)
    assert (foreign.code, foreign.type, foreign.message, foreign.param) == (
        unknown.code,
        unknown.type,
        unknown.message,
        unknown.param,
    )


async def test_create_only_takes_a_free_id(make_store) -> None:
    store = make_store()
    session = conversation()
    assert await store.create(session) is True
    again = Session.new(ALICE, instructions="mine now", max_output_tokens=8, session_id=session.id)
    assert await store.create(again) is False  # taken by the same owner


async def test_session_ids_are_per_owner(make_store) -> None:
    # two keys may both name a session "my-chat": neither squats nor sees the other's
    store = make_store()
    alice = conversation()
    alice.id = "my-chat"
    assert await store.create(alice) is True
    bob = Session.new(BOB, instructions="bob's", max_output_tokens=8, session_id="my-chat")
    assert await store.create(bob) is True  # not taken: ids are per owner
    assert (await store.load("my-chat", ALICE)).instructions == alice.instructions
    assert (await store.load("my-chat", BOB)).instructions == "bob's"
    assert await store.delete("my-chat", BOB) is True
    assert (await store.load("my-chat", ALICE)).instructions == alice.instructions
    await expect_not_found(store, "my-chat", BOB)


async def test_concurrent_updates_lose_nothing(make_store) -> None:
    """Writers appending to one session at once (two replicas, for Redis): every append survives."""
    first = make_store()
    second = first if isinstance(first, MemorySessionStore) else make_store()
    session = conversation()
    await first.save(session)
    base = len(session.items)

    def append(n: int):
        def mutate(s: Session) -> int:
            s.items.append(
                StoredItem(id=f"item_{n}", role="user", parts=[StoredPart("text", text=str(n))])
            )
            return len(s.items)

        return mutate

    await asyncio.gather(
        *(store.update(session.id, ALICE, append(n)) for n, store in enumerate([first, second] * 8))
    )
    stored = await first.load(session.id, ALICE)
    assert sorted(i.id for i in stored.items[base:]) == sorted(f"item_{n}" for n in range(16))
    updated, count = await second.update(session.id, ALICE, append(99))
    assert count == base + 17 and updated.items[-1].id == "item_99"
    await expect_not_found_update(first, session.id, BOB)


async def expect_not_found_update(store, session_id: str, owner: str) -> None:
    with pytest.raises(GatewayError) as err:
        await store.update(session_id, owner, lambda s: None)
    assert err.value.code == "session_not_found"


async def test_save_overwrites_and_stamps_updated_at(make_store) -> None:
    store = make_store()
    session = conversation()
    await store.save(session)
    first = session.updated_at
    session.items.append(
        StoredItem(id="item_3", role="user", parts=[StoredPart("text", text="And the flag?")])
    )
    await asyncio.sleep(0.01)
    await store.save(session)
    loaded = await store.load(session.id, ALICE)
    assert [i.id for i in loaded.items] == ["item_1", "item_2", "item_3"]
    assert loaded.updated_at > first


async def test_loaded_session_is_a_copy(make_store) -> None:
    store = make_store()
    session = conversation()
    await store.save(session)
    loaded = await store.load(session.id, ALICE)
    loaded.items.clear()
    assert len((await store.load(session.id, ALICE)).items) == 2


async def test_delete(make_store) -> None:
    store = make_store()
    session = conversation()
    await store.save(session)
    assert not await store.delete(session.id, BOB)
    assert (await store.load(session.id, ALICE)).id == session.id  # untouched
    assert await store.delete(session.id, ALICE)
    assert not await store.delete(session.id, ALICE)
    assert not await store.delete("sess_missing", ALICE)
    await expect_not_found(store, session.id, ALICE)


async def test_count(make_store) -> None:
    store = make_store()
    assert await store.count() == 0
    a, b = conversation(ALICE), conversation(BOB)
    await store.save(a)
    await store.save(b)
    await store.save(a)  # saving again is not a new session
    assert await store.count() == 2
    await store.delete(a.id, ALICE)
    assert await store.count() == 1


async def test_idle_ttl_expiry_and_refresh(make_store) -> None:
    store = make_store(ttl_s=0.6)
    kept, idle = conversation(), conversation()
    await store.save(kept)
    await store.save(idle)
    await asyncio.sleep(0.35)
    await store.load(kept.id, ALICE)  # refreshes its idle TTL
    await asyncio.sleep(0.35)  # 0.7 s since save: `idle` has expired, `kept` has not
    await expect_not_found(store, idle.id, ALICE)
    assert (await store.load(kept.id, ALICE)).id == kept.id
    assert await store.count() == 1
    await asyncio.sleep(0.7)
    await expect_not_found(store, kept.id, ALICE)
    assert await store.count() == 0


# -- Redis ------------------------------------------------------------------------------------


@pytest.fixture
async def redis_store(redis_url: str):
    made: list[RedisSessionStore] = []

    def make(ttl_s: float = 60.0, **kw) -> RedisSessionStore:
        store = RedisSessionStore(kw.pop("url", redis_url), ttl_s, **kw)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.aclose()


async def test_survives_restart(redis_store) -> None:
    before = redis_store()
    session = conversation()
    await before.save(session)
    await before.aclose()
    after = redis_store()
    assert await after.load(session.id, ALICE) == session
    assert await after.count() == 1


def indexed(raw_redis, store: RedisSessionStore) -> int:
    """Entries in all of the store's bucket indexes, as Redis holds them (expired ones too)."""
    return sum(raw_redis.zcard(index) for index in store.index_keys)


async def test_key_layout_and_ttl(redis_store, raw_redis) -> None:
    store = redis_store(ttl_s=30)
    session = conversation()
    await store.save(session)
    member = f"{session.owner}:{session.id}"
    tag = f"{{{zlib.crc32(member.encode()) % BUCKETS:02x}}}"
    key = f"vg:session:{tag}:{member}"
    assert store.key(session.owner, session.id) == key
    assert msgspec.msgpack.decode(raw_redis.get(key), type=Session) == session
    assert 25_000 < raw_redis.pttl(key) <= 30_000
    expiry_ms = raw_redis.zscore(f"vg:sessions:{tag}", member)
    assert abs(expiry_ms - (time.time() * 1000 + 30_000)) < 5_000
    assert not raw_redis.exists("vg:sessions", f"vg:session:{member}")  # the old layout is gone
    blue = redis_store(namespace="blue")
    await blue.save(conversation())
    assert indexed(raw_redis, blue) == 1 and indexed(raw_redis, store) == 1
    assert all(k.startswith(b"blue:") for k in raw_redis.keys("*blue*"))


async def test_hash_tagged_namespace_keeps_its_tag(redis_store, raw_redis) -> None:
    store = redis_store(namespace="{vg}")
    session = conversation()
    await store.save(session)
    key = store.key(session.owner, session.id)
    assert key.startswith("{vg}:session:{") and key.endswith(f":{session.owner}:{session.id}")
    assert key_slot(key.encode()) == key_slot(b"{vg}") == key_slot(b"{vg}:sessions:{00}")
    assert await store.count() == 1 and (await store.load(session.id, ALICE)) == session


@pytest.mark.parametrize("namespace", ["vg{", "vg{}", "{}vg", "a{b"])
def test_namespace_whose_braces_would_split_a_session_is_refused(namespace: str) -> None:
    with pytest.raises(ValueError, match="hash tag"):
        RedisSessionStore("redis://127.0.0.1:1/0", 60, namespace=namespace)


async def test_load_refreshes_ttl_but_not_for_a_foreign_owner(redis_store, raw_redis) -> None:
    store = redis_store(ttl_s=30)
    session = conversation()
    await store.save(session)
    key = store.key(session.owner, session.id)
    raw_redis.pexpire(key, 5_000)
    await expect_not_found(store, session.id, BOB)
    assert raw_redis.pttl(key) <= 5_000
    await store.load(session.id, ALICE)
    assert raw_redis.pttl(key) > 25_000


async def test_expired_sessions_are_not_counted_forever(redis_store, raw_redis) -> None:
    store = redis_store(ttl_s=0.2)
    for _ in range(3):
        await store.save(conversation())
    assert await store.count() == 3
    await asyncio.sleep(0.3)
    assert await store.count() == 0
    assert indexed(raw_redis, store) == 0  # pruned, not just filtered


async def test_vanished_key_leaves_the_count_within_one_ttl(redis_store, raw_redis) -> None:
    store = redis_store(ttl_s=0.3)
    session = conversation()
    await store.save(session)
    raw_redis.delete(store.key(session.owner, session.id))  # e.g. evicted under maxmemory
    await expect_not_found(store, session.id, ALICE)  # the failed refresh adds nothing back
    await asyncio.sleep(0.4)
    assert await store.count() == 0


async def test_corrupted_value_is_not_found(redis_store, raw_redis) -> None:
    store = redis_store()
    session = conversation()
    await store.save(session)
    key = store.key(session.owner, session.id)
    for garbage in (b"\xc1\xc1\xc1", msgspec.msgpack.encode({"id": session.id, "owner": 7}), b""):
        raw_redis.set(key, garbage)
        with capture_logs() as logs:
            await expect_not_found(store, session.id, ALICE)
            assert not await store.delete(session.id, ALICE)
        assert logs and all(
            e["event"] == "session_corrupt" and e["log_level"] == "error" for e in logs
        )
    assert await store.count() == 1
    await store.save(session)  # the next save overwrites it
    assert await store.load(session.id, ALICE) == session


async def test_value_stored_under_another_id_is_not_found(redis_store, raw_redis) -> None:
    store = redis_store()
    session = conversation()
    await store.save(session)
    raw_redis.copy(store.key(session.owner, session.id), store.key(session.owner, "sess_other"))
    await expect_not_found(store, "sess_other", ALICE)


async def test_concurrent_saves_from_two_replicas(redis_store) -> None:
    a, b = redis_store(), redis_store()
    sessions = [conversation() for _ in range(20)]
    await asyncio.gather(*(store.save(s) for s in sessions for store in (a, b)))
    assert await a.count() == 20
    for s in sessions:  # whichever replica wrote last, the content is the same
        loaded = await b.load(s.id, ALICE)
        assert msgspec.structs.replace(loaded, updated_at=s.updated_at) == s


async def test_unreachable_redis_is_busy(redis_store) -> None:
    store = redis_store(url=f"redis://127.0.0.1:{free_port()}/0")
    with capture_logs() as logs, pytest.raises(GatewayError) as info:
        await store.save(conversation())
    assert info.value.code == "busy" and info.value.http_status == 503
    assert logs[-1]["event"] == "session_store_unavailable"
    for call in (store.load("sess_x", ALICE), store.delete("sess_x", ALICE), store.count()):
        with pytest.raises(GatewayError, match="unavailable"):
            await call


async def test_factory(redis_url: str) -> None:
    memory = make_session_store(None, 60)
    assert isinstance(memory, MemorySessionStore) and memory.ttl_s == 60
    store = make_session_store(redis_url, 60)
    assert isinstance(store, RedisSessionStore) and store.ttl_s == 60
    session = conversation()
    await store.save(session)
    assert await store.load(session.id, ALICE) == session
    await store.aclose()


async def test_a_replayed_write_counts_as_done(redis_store, raw_redis) -> None:
    """The client resends a script when a connection drops before its reply: the resend must
    report the write as done, so create() does not call the id taken, update() does not apply
    its change twice, and delete() does not answer that nothing was deleted."""
    store = redis_store()
    session = conversation()
    keys, member = store._keys(ALICE, session.id), f"{ALICE}:{session.id}"
    first = msgspec.msgpack.encode(session)
    for _ in range(2):
        assert await store._create(keys=keys, args=[first, 60_000, member]) == 1
    session.items.pop()
    second = msgspec.msgpack.encode(session)
    for _ in range(2):
        assert await store._replace(keys=keys, args=[first, second, 60_000, member]) == 1
    assert raw_redis.get(keys[0]) == second
    assert await store._replace(keys=keys, args=[first, b"other", 60_000, member]) == 0
    assert await store._create(keys=keys, args=[b"other", 60_000, member]) == 0
    # a delete resent after its reply was lost finds the key gone: done, not "changed"
    assert await store._delete(keys=keys, args=[first, member]) == 0  # not the value read
    for expected in (1, 2):
        assert await store._delete(keys=keys, args=[second, member]) == expected
    assert not raw_redis.exists(keys[0]) and raw_redis.zscore(keys[1], member) is None
