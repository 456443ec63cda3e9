"""The gateway's Redis tiers on a real 3-master Redis Cluster: the image store and its
ownership index, the vision cache, KV spill and rate limits, each shared by two replicas' worth
of clients and spread over the masters. Before, every one of them got MOVED on a cluster and
fell back to memory (or, for rate limits, failed open)."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest

from encoder_worker.redis_conn import sync_client
from encoder_worker.storage import image_key, owner_key, vision_key
from gateway.caching import MemoryImageStore, MemoryVisionCache, RedisImageStore, TieredVisionCache
from gateway.policy.ratelimit import RedisRateLimiter
from gateway.protocol.errors import GatewayError

FINGERPRINT = "f" * 64


def masters_holding(raw_cluster, keys: list[str]) -> set[str]:
    return {raw_cluster.get_node_from_key(k).name for k in keys}


async def test_images_owners_and_visual_tokens_are_shared_through_the_cluster(
    redis_cluster_url, raw_cluster
) -> None:
    blobs = [f"image {i}".encode() * 50 for i in range(12)]
    digests = [hashlib.sha256(b).hexdigest() for b in blobs]
    a_images = RedisImageStore(MemoryImageStore(1 << 20), redis_cluster_url, 60)
    a_vision = TieredVisionCache(MemoryVisionCache(1 << 20), redis_cluster_url, 60)
    for blob, digest in zip(blobs, digests, strict=True):
        await a_images.put(digest, blob)
        await a_images.owners.add("owner-a", digest)
        await a_vision.put(FINGERPRINT, digest, b"tokens of " + digest.encode())
    await a_images.owners.mark_used("owner-a", digests[0])
    assert a_images.redis_errors == 0 and (await a_vision.stats()).redis_errors == 0

    # another replica: nothing in its memory, everything from the cluster
    b_images = RedisImageStore(MemoryImageStore(1 << 20), redis_cluster_url, 60)
    b_vision = TieredVisionCache(MemoryVisionCache(1 << 20), redis_cluster_url, 60)
    for blob, digest in zip(blobs, digests, strict=True):
        assert await b_images.get(digest) == blob
        hit = await b_vision.get(FINGERPRINT, digest)
        assert hit is not None and hit.tier == "redis"
        assert hit.payload == b"tokens of " + digest.encode()
    assert await b_images.owners.state("owner-a", digests[0]) == "used"
    assert await b_images.owners.state("owner-a", digests[1]) == "sent"
    assert await b_images.owners.state("owner-b", digests[1]) is None
    assert b_images.redis_errors == 0 and (await b_vision.stats()).redis_errors == 0

    keys = [image_key(d) for d in digests] + [vision_key(FINGERPRINT, d) for d in digests]
    keys += [owner_key("owner-a", d) for d in digests]
    assert all(raw_cluster.exists(k) for k in keys)
    assert len(masters_holding(raw_cluster, keys)) >= 2  # spread over the shards
    for store in (a_images, a_vision, b_images, b_vision):
        await store.aclose()


def test_kv_spilled_by_one_replica_is_loaded_by_another(redis_cluster_url, raw_cluster) -> None:
    from gateway.engine.local.kv.redis_store import RedisKVStore
    from tests.gateway.engine.local.test_engine_kvstore import SEED, make_entry, same

    writer = RedisKVStore(redis_cluster_url, seed=SEED)
    entries = {f"session-{i}": make_entry(list(range(i, i + 8)), fill=i) for i in range(8)}
    for key, entry in entries.items():
        writer.put(key, entry)
    writer.close()  # drains the write-behind queue
    reader = RedisKVStore(redis_cluster_url, seed=SEED)
    for key, entry in entries.items():
        loaded = reader.get(key, entry.hashes)
        assert loaded is not None and same(loaded, entry), key
    stored = [writer.redis_key(k) for k in entries]
    assert all(raw_cluster.exists(k) for k in stored)
    assert len(masters_holding(raw_cluster, stored)) >= 2
    reader.close()


async def test_rate_limit_holds_across_replicas_on_the_cluster(redis_cluster_url) -> None:
    if time.time() % 60 > 55:  # one fixed window for the whole test
        await asyncio.sleep(61 - time.time() % 60)
    replicas = [RedisRateLimiter(3, redis_cluster_url) for _ in range(2)]
    outcomes = []
    for i in range(8):
        try:
            await replicas[i % 2].acquire("owner-a")
            outcomes.append("ok")
        except GatewayError as exc:
            outcomes.append(exc.code)
    assert outcomes == ["ok"] * 3 + ["rate_limited"] * 5
    await replicas[0].acquire("owner-b")  # another key has its own allowance
    for limiter in replicas:
        await limiter.aclose()


async def test_an_unreachable_cluster_is_a_cache_miss_not_an_error(unused_tcp_port) -> None:
    url = f"redis+cluster://127.0.0.1:{unused_tcp_port}"
    images = RedisImageStore(MemoryImageStore(1 << 20), url, 60)
    vision = TieredVisionCache(MemoryVisionCache(1 << 20), url, 60)
    digest = hashlib.sha256(b"x").hexdigest()
    await images.put(digest, b"x")  # kept in memory; the cluster's failure is logged, not raised
    assert await images.get(digest) == b"x"
    assert await vision.get(FINGERPRINT, "0" * 64) is None
    assert images.redis_errors >= 1
    limiter = RedisRateLimiter(1, url)
    await limiter.acquire("owner-a")  # fails open while Redis is away, as on one node
    from gateway.engine.local.kv.redis_store import RedisKVStore

    kv = RedisKVStore(url, seed=b"s" * 16)  # made without a connection: starts anyway
    assert kv.get("session-1") is None
    kv.close()
    for closable in (images, vision, limiter):
        await closable.aclose()


@pytest.mark.slow
async def test_a_hung_master_costs_a_rate_limit_seconds_not_minutes() -> None:
    """With one master frozen (SIGSTOP: no reply, no reset), no request waits past the rate
    limiter's deadline: a counter on it fails open, and so at worst does one on another master
    while the client rebuilds its slot map (redis-py's default would hold each for ~25 s)."""
    import signal

    from tests.conftest import redis_cluster

    with redis_cluster() as (url, masters):
        if time.time() % 60 > 45:  # the counters' keys must not change minute mid-test
            await asyncio.sleep(61 - time.time() % 60)
        limiter = RedisRateLimiter(100, url)
        probe = sync_client(url)
        owners = [f"owner-{i}" for i in range(40)]
        for owner in owners:  # warm: the client knows every master
            await limiter.acquire(owner)
        frozen = masters[0]
        frozen_port = int(frozen.args[frozen.args.index("--port") + 1])
        window = int(time.time() // 60)

        def on_frozen(owner: str) -> bool:
            return probe.get_node_from_key(f"vg:rate:{owner}:{window}").port == frozen_port

        stuck = next(o for o in owners if on_frozen(o))
        fine = next(o for o in owners if not on_frozen(o))
        frozen.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            await limiter.acquire(stuck)
            assert time.monotonic() - started < 5.0
            # a key on a healthy master: right away, or (when this call is the one that
            # rebuilds the client's slot map and asks the frozen node first) within the deadline
            started = time.monotonic()
            await limiter.acquire(fine)
            assert time.monotonic() - started < 5.0
        finally:
            frozen.send_signal(signal.SIGCONT)
        await limiter.aclose()
        probe.close()


@pytest.fixture
def unused_tcp_port() -> int:
    from tests.conftest import free_port

    return free_port()
