"""The ephemeral-key store's contract on memory, a real Redis and a real Redis Cluster, and what
`Authenticator.grant` makes of a record: its parent checked, expiry, store outages."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.policy.auth import Authenticator
from gateway.policy.client_secrets import (
    EXPIRED_KEPT_S,
    MAX_MINTS_PER_MINUTE,
    ClientSecret,
    MemoryClientSecretStore,
    RedisClientSecretStore,
    new_client_secret,
    secret_digest,
)
from gateway.policy.key_store import KeyRecord, MemoryKeyStore, new_key_id
from gateway.protocol.errors import GatewayError

STATIC = "sk-static-5b8e0f2d9c41a7"


def record(owner: str = "key_x", kind: str = "static", ttl: float = 60.0, **kw) -> ClientSecret:
    now = time.time()
    return ClientSecret(owner=owner, parent_kind=kind, created_at=now, expires_at=now + ttl, **kw)  # type: ignore[arg-type]


def offered(secret: str) -> list[str]:
    return ["realtime", f"openai-insecure-api-key.{secret}"]


async def contract(store) -> None:
    secret = new_client_secret()
    assert secret.startswith("ek_") and len(secret) == 46
    digest = secret_digest(secret)
    assert await store.get(digest) is None
    made = record(session=b'{"instructions":"x"}')
    await store.put(digest, made)
    got = await store.get(digest)
    assert got == made and got is not made
    assert await store.get(secret_digest(new_client_secret())) is None


async def test_memory_store_contract_expiry_and_bound() -> None:
    now = [time.time()]
    store = MemoryClientSecretStore(max_records=3, clock=lambda: now[0])
    await contract(store)
    digest = secret_digest(new_client_secret())
    await store.put(digest, record(ttl=10))
    now[0] += 10 + EXPIRED_KEPT_S - 1
    assert (await store.get(digest)).expired(now[0])  # kept past expiry: "expired", not "unknown"
    now[0] += 2
    assert await store.get(digest) is None
    # full of live records: busy; once some expire, room again
    live = now[0] - time.time() + 10  # live for 10 s on the store's clock
    while len(store) < 3:
        await store.put(secret_digest(new_client_secret()), record(ttl=live))
    with pytest.raises(GatewayError) as full:
        await store.put(secret_digest(new_client_secret()), record(ttl=live))
    assert full.value.code == "busy"
    now[0] += 60 + EXPIRED_KEPT_S + 1
    await store.put(secret_digest(new_client_secret()), record(ttl=now[0] - time.time() + 10))
    assert len(store) == 1


async def test_memory_store_bounds_its_bytes() -> None:
    store = MemoryClientSecretStore(max_bytes=4096)
    big = record(session=b"x" * 3000)
    await store.put(secret_digest(new_client_secret()), big)
    with pytest.raises(GatewayError) as full:
        await store.put(secret_digest(new_client_secret()), big)
    assert full.value.code == "busy"
    await store.put(secret_digest(new_client_secret()), record())  # a small one still fits


async def mints_are_bounded_per_owner(store, next_minute) -> None:
    for _ in range(MAX_MINTS_PER_MINUTE):
        await store.put(secret_digest(new_client_secret()), record(owner="key_busy"))
    with pytest.raises(GatewayError) as limited:
        await store.put(secret_digest(new_client_secret()), record(owner="key_busy"))
    assert limited.value.code == "rate_limited" and 0 < limited.value.retry_after_s <= 60
    await store.put(secret_digest(new_client_secret()), record(owner="key_other"))
    next_minute()
    await store.put(secret_digest(new_client_secret()), record(owner="key_busy"))


async def test_memory_store_bounds_mints_per_owner() -> None:
    now = [time.time()]

    def next_minute() -> None:
        now[0] += 60

    await mints_are_bounded_per_owner(MemoryClientSecretStore(clock=lambda: now[0]), next_minute)


async def test_redis_store_bounds_mints_per_owner(redis_url, raw_redis) -> None:
    store = RedisClientSecretStore(redis_url)

    def next_minute() -> None:  # the minute's counter gone, as at the next minute
        for key in raw_redis.keys("vg:client-secret-mints:key_busy:*"):
            assert 0 < raw_redis.ttl(key) <= 120
            raw_redis.delete(key)

    if 60 - time.time() % 60 < 5:  # all the mints in one minute
        await asyncio.sleep(6)
    try:
        await mints_are_bounded_per_owner(store, next_minute)
    finally:
        await store.aclose()


async def test_redis_store_contract_nothing_secret_at_rest(redis_url, raw_redis) -> None:
    store = RedisClientSecretStore(redis_url)
    try:
        await contract(store)
        secret = new_client_secret()
        await store.put(secret_digest(secret), record(ttl=30))
        key = f"vg:client-secret:{secret_digest(secret)}"
        assert 30 < raw_redis.ttl(key) <= 30 + EXPIRED_KEPT_S
        for k in raw_redis.keys("*"):
            assert secret.encode() not in k and secret.encode() not in raw_redis.get(k)
    finally:
        await store.aclose()


async def test_redis_cluster_store_contract(redis_cluster_url) -> None:
    store = RedisClientSecretStore(redis_cluster_url)
    try:
        for _ in range(5):  # keys land on different slots: single-key commands only
            await contract(store)
    finally:
        await store.aclose()


async def test_redis_outage_is_busy_never_a_pass() -> None:
    from gateway.testing.ports import free_port

    store = RedisClientSecretStore(f"redis://127.0.0.1:{free_port()}")
    auth = Authenticator([STATIC], client_secrets=store)
    secret = new_client_secret()
    try:
        with pytest.raises(GatewayError) as put:
            await store.put(secret_digest(secret), record())
        assert put.value.code == "busy"
        with pytest.raises(GatewayError) as granted:
            await auth.grant({}, offered(secret))
        assert granted.value.code == "busy"
    finally:
        await store.aclose()


async def test_grant_checks_the_record_and_its_parent() -> None:
    store = MemoryClientSecretStore()
    keys = MemoryKeyStore()
    auth = Authenticator([STATIC], keys, client_secrets=store, cache_ttl_s=0.0)
    static_owner = auth.static_owner(STATIC)
    assert static_owner is not None

    async def mint(**kw) -> str:
        secret = new_client_secret()
        await store.put(secret_digest(secret), record(**kw))
        return secret

    async def code(secret: str) -> str:
        with pytest.raises(GatewayError) as exc:
            await auth.grant({}, offered(secret))
        return exc.value.code

    ok = await mint(owner=static_owner)
    grant = await auth.grant({"authorization": f"Bearer {ok}"})
    assert grant.owner == static_owner and grant.ephemeral is not None
    # never on an HTTP API, valid or not, and never minted from
    for key in (ok, "ek_forged"):
        with pytest.raises(GatewayError) as http:
            auth.owner({"authorization": f"Bearer {key}"})
        assert http.value.code == "permission_denied"
        with pytest.raises(GatewayError) as parent:
            auth.parent_of({"authorization": f"Bearer {key}"})
        assert parent.value.code == "permission_denied"
    assert await code("ek_" + "Q" * 43) == "unauthorized"
    assert await code(await mint(owner=static_owner, ttl=-1)) == "api_key_expired"
    # a static parent no longer configured (another replica's settings, a restart)
    assert await code(await mint(owner="key_0000000000000000")) == "unauthorized"
    # minted on a gateway without keys, used after keys were turned on
    assert await code(await mint(owner="anonymous", kind="anonymous")) == "unauthorized"
    # a managed parent: revoked, expired, gone
    key_id = new_key_id()
    await keys.create(KeyRecord(id=key_id, name="p", created=time.time()), "d" * 64)
    managed = await mint(owner=key_id, kind="managed", parent_id=key_id)
    assert (await auth.grant({}, offered(managed))).owner == key_id
    assert auth.limits_of(key_id) is not None  # its limits are the rate limiter's to read
    await keys.revoke(key_id, time.time())
    assert await code(managed) == "api_key_revoked"
    orphan = await mint(owner="key_" + "0" * 24, kind="managed", parent_id="key_" + "0" * 24)
    assert await code(orphan) == "unauthorized"
