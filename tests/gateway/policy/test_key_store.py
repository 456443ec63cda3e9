"""The key store's one contract on memory, a real redis-server and a real Redis Cluster; the
Authenticator over it (cache, revocation, expiry, a store that stops answering)."""

from __future__ import annotations

import time

import pytest

from gateway.policy.auth import Authenticator
from gateway.policy.key_store import (
    KeyRecord,
    KeyUsage,
    MemoryKeyStore,
    RedisKeyStore,
    new_key_id,
    new_secret,
    secret_digest,
    usage_day,
)
from gateway.protocol.errors import GatewayError
from gateway.testing.clock import ManualClock


@pytest.fixture(params=["memory", "redis", "cluster"])
async def store(request):
    if request.param == "memory":
        s = MemoryKeyStore()
    else:
        url = request.getfixturevalue(
            "redis_url" if request.param == "redis" else "redis_cluster_url"
        )
        s = RedisKeyStore(url, namespace=f"t{time.monotonic_ns()}")
    yield s
    await s.aclose()


def record(**kw) -> KeyRecord:
    return KeyRecord(id=new_key_id(), name="n", created=time.time(), **kw)


async def test_contract(store) -> None:
    secret = new_secret()
    r = record(owner="acme", rpm=5, models=["m"])
    await store.create(r, secret_digest(secret))
    with pytest.raises(ValueError):
        await store.create(r, secret_digest(secret))
    assert await store.by_digest(secret_digest(secret)) == r
    assert await store.by_digest(secret_digest(new_secret())) is None
    assert await store.by_id(r.id) == r and await store.by_id(new_key_id()) is None
    others = []
    for _ in range(4):
        o = record()
        await store.create(o, secret_digest(new_secret()))
        others.append(o)
    # ids sort by creation to the millisecond (then at random): pages follow id order
    ids = sorted([r.id, *(o.id for o in others)])
    assert [x.id for x in await store.page(None, 10)] == ids
    assert [x.id for x in await store.page(ids[1], 2)] == ids[2:4]
    revoked = await store.revoke(r.id, 123.0)
    assert revoked.revoked and revoked.revoked_at == 123.0
    assert (await store.revoke(r.id, 456.0)).revoked_at == 123.0  # idempotent
    assert (await store.by_digest(secret_digest(secret))).revoked
    assert await store.revoke(new_key_id(), 1.0) is None
    await store.count_usage(r.id, requests=2, input_tokens=10, output_tokens=3)
    await store.count_usage(r.id, requests=1)
    (u,) = await store.usage([r.id])
    assert (u.requests, u.input_tokens, u.output_tokens) == (3, 10, 3)


async def test_usage_counts_totals_and_days(store) -> None:
    r, other = record(), record()
    await store.count_usage(
        r.id,
        requests=1,
        input_tokens=40,
        cached_tokens=8,
        output_tokens=5,
        image_tokens=30,
        encode_ms=12,
    )
    await store.count_usage(r.id, input_tokens=2, output_tokens=1)
    (total,) = await store.usage([r.id])
    assert total == KeyUsage(r.id, 1, 42, 8, 6, 30, 12)
    today = usage_day()
    # today's counts are the totals (every count was made today); other days hold none
    assert await store.usage([r.id], [today]) == [total]
    assert await store.usage([r.id, other.id], ["20200101", today]) == [
        total,
        KeyUsage(other.id),
    ]
    assert await store.usage([r.id], ["20200101"]) == [KeyUsage(r.id)]


async def test_nothing_secret_at_rest(redis_url, raw_redis) -> None:
    store = RedisKeyStore(redis_url, namespace="atrest")
    secret = new_secret()
    await store.create(record(), secret_digest(secret))
    for key in raw_redis.keys("atrest:*"):
        assert secret.encode() not in key
        if raw_redis.type(key) == b"string":
            assert secret.encode() not in raw_redis.get(key)
    await store.aclose()


async def test_authenticator_cache_revocation_and_outage() -> None:
    store, clock = MemoryKeyStore(), ManualClock()
    auth = Authenticator(["static-key-1234"], store, clock=clock)
    secret, expired_secret = new_secret(), new_secret()
    r = record()
    await store.create(r, secret_digest(secret))
    await store.create(record(expires_at=time.time() - 1), secret_digest(expired_secret))
    headers = {"authorization": f"Bearer {secret}"}
    with pytest.raises(GatewayError):  # nothing prefetched nor cached: owner() cannot know
        auth.owner(headers)
    await auth.prefetch(headers)
    assert auth.owner(headers) == r.id
    assert auth.owner({"authorization": "Bearer static-key-1234"}).startswith("key_")
    await store.revoke(r.id, time.time())
    assert await auth.resolve(headers) == r.id  # cached for cache_ttl_s
    clock.now += 1.1
    with pytest.raises(GatewayError) as refused:
        await auth.resolve(headers)
    assert refused.value.code == "api_key_revoked"
    with pytest.raises(GatewayError) as refused:
        await auth.resolve({"authorization": f"Bearer {expired_secret}"})
    assert refused.value.code == "api_key_expired"
    with pytest.raises(GatewayError) as refused:
        await auth.resolve({"authorization": f"Bearer {new_secret()}"})
    assert refused.value.code == "unauthorized"

    auth.store = RedisKeyStore("redis://127.0.0.1:1/0")  # a Redis that does not answer
    clock.now += 1.1
    with pytest.raises(GatewayError) as refused:  # a recent read stands in: still revoked
        await auth.resolve(headers)
    assert refused.value.code == "api_key_revoked"
    with pytest.raises(GatewayError) as refused:  # nothing cached: busy, never a pass
        await auth.resolve({"authorization": f"Bearer {new_secret()}"})
    assert refused.value.code == "busy"
    await auth.store.aclose()
