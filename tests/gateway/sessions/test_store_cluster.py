"""RedisSessionStore and RedisResponseStore on a real 3-master Redis Cluster: every script stays
in one hash slot, sessions spread over the masters, and behaviour matches a single Redis."""

from __future__ import annotations

import asyncio
import time

import pytest
from structlog.testing import capture_logs

from gateway.protocol.errors import GatewayError
from gateway.sessions import RedisSessionStore, Session, StoredItem, StoredPart
from gateway.sessions.response_records import RedisResponseStore, ResponseRecord
from tests.conftest import free_port

ALICE, BOB = "key_alice", "key_bob"


def conversation(owner: str = ALICE, session_id: str | None = None) -> Session:
    session = Session.new(
        owner, instructions="Be brief.", max_output_tokens=64, session_id=session_id
    )
    session.items.append(
        StoredItem(id="item_1", role="user", parts=[StoredPart("text", text="Hello?")])
    )
    return session


def append(n: int):
    def mutate(session: Session) -> int:
        session.items.append(
            StoredItem(id=f"item_n{n}", role="user", parts=[StoredPart("text", text=str(n))])
        )
        return len(session.items)

    return mutate


@pytest.fixture
async def cluster_store(redis_cluster_url: str):
    made: list[RedisSessionStore] = []

    def make(ttl_s: float = 60.0, **kw) -> RedisSessionStore:
        store = RedisSessionStore(kw.pop("url", redis_cluster_url), ttl_s, **kw)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.aclose()


async def expect_not_found(store: RedisSessionStore, session_id: str, owner: str) -> None:
    with pytest.raises(GatewayError) as info:
        await store.load(session_id, owner)
    assert info.value.code == "session_not_found"


def indexed(raw_cluster, store: RedisSessionStore) -> int:
    """Entries in all of the store's bucket indexes as the cluster holds them (expired too)."""
    pipe = raw_cluster.pipeline(transaction=False)
    for index in store.index_keys:
        pipe.zcard(index)
    return sum(pipe.execute())


async def test_lifecycle_on_a_cluster(cluster_store) -> None:
    store = cluster_store()
    assert await store.count() == 0
    session = conversation()
    assert await store.create(session) is True
    assert await store.create(conversation(session_id=session.id)) is False
    assert await store.load(session.id, ALICE) == session
    updated, length = await store.update(session.id, ALICE, append(1))
    assert length == 2 and updated.items[-1].id == "item_n1"
    assert [i.id for i in (await store.load(session.id, ALICE)).items] == ["item_1", "item_n1"]
    others = [conversation() for _ in range(30)]
    for other in others:
        await store.save(other)
    await store.save(others[0])  # saving again is not a new session
    assert await store.count() == 31
    assert await store.delete(session.id, ALICE) is True
    assert await store.delete(session.id, ALICE) is False
    await expect_not_found(store, session.id, ALICE)
    assert await store.count() == 30


async def test_every_script_names_one_slot_and_sessions_spread(cluster_store, raw_cluster) -> None:
    store = cluster_store()
    sessions = [conversation(owner) for owner in (ALICE, BOB) for _ in range(40)]
    await asyncio.gather(*(store.save(s) for s in sessions))
    masters = set()
    for s in sessions:
        key, index = store.key(s.owner, s.id), store.index_key(s.owner, s.id)
        assert raw_cluster.cluster_keyslot(key) == raw_cluster.cluster_keyslot(index)
        assert raw_cluster.exists(key) == 1
        assert raw_cluster.zscore(index, f"{s.owner}:{s.id}") is not None
        masters.add(raw_cluster.get_node_from_key(key).name)
    assert len(masters) >= 2, masters
    slots = {raw_cluster.cluster_keyslot(index) for index in store.index_keys}
    assert len(slots) > len(store.index_keys) // 2  # buckets are distinct slots, not one
    assert await store.count() == len(sessions)


async def test_concurrent_updates_lose_nothing(cluster_store) -> None:
    """Twenty appends at once from two replicas to one session: every one survives."""
    first, second = cluster_store(), cluster_store()
    session = conversation()
    await first.save(session)
    writers = enumerate([first, second] * 10)
    results = await asyncio.gather(*(s.update(session.id, ALICE, append(n)) for n, s in writers))
    assert sorted(length for _, length in results) == list(range(2, 22))  # each saw its own turn
    stored = await second.load(session.id, ALICE)
    assert sorted(i.id for i in stored.items[1:]) == sorted(f"item_n{n}" for n in range(20))


async def test_first_burst_of_a_new_replica(cluster_store) -> None:
    """A replica's first commands arrive all at once, before its client knows the slots."""
    writer = cluster_store()
    sessions = [conversation() for _ in range(40)]
    for s in sessions:
        await writer.save(s)
    reader = cluster_store()
    loaded = await asyncio.gather(*(reader.load(s.id, ALICE) for s in sessions))
    assert [s.id for s in loaded] == [s.id for s in sessions]


async def test_owner_isolation(cluster_store) -> None:
    store = cluster_store()
    alice = conversation(ALICE, session_id="my-chat")
    bob = conversation(BOB, session_id="my-chat")
    bob.instructions = "bob's"
    assert await store.create(alice) is True
    assert await store.create(bob) is True  # ids are per owner
    assert (await store.load("my-chat", BOB)).instructions == "bob's"
    assert (await store.load("my-chat", ALICE)).instructions == "Be brief."
    with pytest.raises(GatewayError) as info:
        await store.update("my-chat", "key_carol", append(0))
    assert info.value.code == "session_not_found"
    assert await store.delete("my-chat", "key_carol") is False
    assert await store.delete("my-chat", BOB) is True
    await expect_not_found(store, "my-chat", BOB)
    assert (await store.load("my-chat", ALICE)).instructions == "Be brief."
    assert await store.count() == 1


async def test_count_drops_expired_entries(cluster_store, raw_cluster) -> None:
    # a TTL long enough for 13 writes on a busy machine (0.3 s was not, at a load of 9 on 2
    # cores), short enough to wait out
    store = cluster_store(ttl_s=1.5)
    kept = cluster_store(ttl_s=60)
    for _ in range(12):
        await store.save(conversation())
    long_lived = conversation(BOB)
    await kept.save(long_lived)
    assert await store.count() == 13 and indexed(raw_cluster, store) == 13
    await asyncio.sleep(1.7)
    assert await store.count() == 1
    assert indexed(raw_cluster, store) == 1  # pruned, not just filtered
    assert (await kept.load(long_lived.id, BOB)).id == long_lived.id


async def test_scripts_are_loaded_again_on_nodes_that_lost_them(cluster_store, raw_cluster) -> None:
    store = cluster_store()
    sessions = [conversation() for _ in range(10)]
    for s in sessions:
        await store.save(s)
    assert await store.count() == 10
    raw_cluster.script_flush()  # every master forgets them, as after a restart
    assert await store.count() == 10
    await store.save(conversation())
    await store.update(sessions[0].id, ALICE, append(3))
    assert await store.delete(sessions[1].id, ALICE) is True
    assert await store.count() == 10


async def test_hash_tagged_namespace_is_one_slot_and_still_correct(
    cluster_store, raw_cluster
) -> None:
    store = cluster_store(namespace="{vg}")
    sessions = [conversation() for _ in range(20)]
    for s in sessions:
        await store.save(s)
    slots = {raw_cluster.cluster_keyslot(store.key(s.owner, s.id)) for s in sessions}
    assert slots == {raw_cluster.cluster_keyslot("{vg}")}
    await store.update(sessions[0].id, ALICE, append(7))
    assert (await store.load(sessions[0].id, ALICE)).items[-1].id == "item_n7"
    assert await store.delete(sessions[1].id, ALICE) is True
    assert await store.count() == 19


async def test_same_layout_on_one_node_and_on_a_cluster(
    cluster_store, raw_cluster, redis_url: str, raw_redis
) -> None:
    """The store is the same code on both: the same session lands under the same key names."""
    single, cluster = cluster_store(url=redis_url), cluster_store()
    sessions = [conversation(owner) for owner in (ALICE, BOB) for _ in range(5)]
    for s in sessions:
        await single.save(s)
        await cluster.save(s)
    on_node = {k.decode() for k in raw_redis.keys("vg:*")}
    on_cluster = {k.decode() for k in raw_cluster.keys("vg:*", target_nodes="primaries")}
    assert on_node == on_cluster
    assert len(on_node) == 10 + len({single.index_key(s.owner, s.id) for s in sessions})
    assert await single.count() == await cluster.count() == 10


async def test_unreachable_cluster_is_busy(cluster_store) -> None:
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    store = cluster_store(url=url)
    with capture_logs() as logs, pytest.raises(GatewayError) as info:
        await store.save(conversation())
    assert info.value.code == "busy" and info.value.http_status == 503
    assert logs[-1]["event"] == "session_store_unavailable"
    for call in (store.load("sess_x", ALICE), store.count()):
        with pytest.raises(GatewayError, match="unavailable"):
            await call


# -- stored responses ---------------------------------------------------------------------------


@pytest.fixture
async def response_store(redis_cluster_url: str):
    made: list[RedisResponseStore] = []

    def make(ttl_s: float = 60.0, url: str = redis_cluster_url) -> RedisResponseStore:
        store = RedisResponseStore(url, ttl_s)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.aclose()


def record(n: int, owner: str = ALICE) -> ResponseRecord:
    return ResponseRecord(
        id=f"resp_{n}",
        owner=owner,
        created_at=time.time(),
        body=b'{"id": "resp_%d"}' % n,
        session_id=f"sess_{n}",
        last_item_id=f"item_{n}",
        input_items=b'[{"type": "message"}]',
    )


async def test_response_records_round_trip_on_a_cluster(response_store, raw_cluster) -> None:
    store = response_store(ttl_s=30)
    records = [record(n) for n in range(30)]
    for r in records:
        await store.put(r)
    masters = {raw_cluster.get_node_from_key(store.key(ALICE, r.id)).name for r in records}
    assert len(masters) >= 2, masters
    for r in records:
        assert await store.get(r.id, ALICE) == r
        assert await store.get(r.id, BOB) is None  # another key's record reads as unknown
    key = store.key(ALICE, "resp_0")
    raw_cluster.pexpire(key, 5_000)
    assert await store.get("resp_0", BOB) is None and raw_cluster.pttl(key) <= 5_000
    await store.get("resp_0", ALICE)  # reading refreshes the idle TTL
    assert raw_cluster.pttl(key) > 25_000
    assert await store.delete("resp_0", BOB) is False
    assert await store.delete("resp_0", ALICE) is True
    assert await store.get("resp_0", ALICE) is None
    assert await store.delete("resp_0", ALICE) is False
    raw_cluster.script_flush()
    assert await store.delete("resp_1", ALICE) is True  # its script reloads on the node


async def test_response_records_expire_on_a_cluster(response_store) -> None:
    store = response_store(ttl_s=0.2)
    await store.put(record(1))
    assert await store.get("resp_1", ALICE) is not None
    await asyncio.sleep(0.3)
    assert await store.get("resp_1", ALICE) is None


async def test_unreachable_cluster_response_store_is_busy(response_store) -> None:
    store = response_store(url=f"redis+cluster://127.0.0.1:{free_port()}")
    with pytest.raises(GatewayError) as info:
        await store.put(record(1))
    assert info.value.code == "busy"
    with pytest.raises(GatewayError, match="unavailable"):
        await store.get("resp_1", ALICE)
