"""Images are private to the API key that sent them.

Two keys on one gateway (and, with Redis, on two gateways sharing it): a key may reference,
poll or probe only images it sent itself; another key's digest reads exactly like an unknown
one. The encode of an image two keys both sent may be shared underneath, but the second key's
first use is reported and timed as its own encode (a miss, the original encode's stage time);
with `share_encodes_across_keys=false` each key's images are encoded apart.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import pytest

from encoder_worker.storage import image_key, owner_key, scoped_digest
from gateway.caching import (
    MemoryOwnerIndex,
    RedisOwnerIndex,
    make_image_store,
    make_vision_cache,
)
from gateway.caching._redis_client import RedisTier
from gateway.chat.vision_resolver import VisionResolver
from gateway.protocol.errors import GatewayError
from gateway.testing.fake_gateway import FakeGateway, GatewayFactory
from gateway.testing.fakes import FakeEncoder
from gateway.testing.realtime_peer import Peer, data_url, deltas
from tests.conftest import unique_photo

TIMEOUT = 10.0
KEYS = ["ka", "kb"]
ENCODE_S = 0.3  # the fake encoder's time per image, reported as its `vision` stage
MODEL = "fake-echo"


def owner_of(gateway: FakeGateway, key: str) -> str:
    return gateway.state.auth.owner({"authorization": f"Bearer {key}"})


def peer_for(gateway: FakeGateway, key: str) -> AbstractAsyncContextManager[Peer]:
    """A Realtime peer that authenticates the way a browser does: the key in a subprotocol."""
    return Peer.connected(gateway.ws_url, api_key=key, subprotocols=["realtime"])


def http_for(gateway: FakeGateway, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=gateway.http_url, headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT
    )


def image_part(url: str) -> dict[str, Any]:
    return {"type": "input_image", "image_url": url}


def chat_body(url: str, text: str = "what is it") -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": text},
                ],
            }
        ],
    }


async def send_image(peer: Peer, url: str) -> dict[str, Any]:
    """Add an item with one image; the `visiongate.image.encoded` event it gets."""
    await peer.add([image_part(url), {"type": "input_text", "text": "look"}])
    event, _ = await peer.until("visiongate.image.encoded", "error", timeout=TIMEOUT)
    assert event["type"] == "visiongate.image.encoded", event
    await peer.until("conversation.item.done", timeout=TIMEOUT)
    return event


async def refused_reference(peer: Peer, digest: str) -> dict[str, Any]:
    """The error an item referencing `digest` gets; the item is not added."""
    await peer.add([image_part(f"visiongate:sha256:{digest}")], event_id="ref")
    event, before = await peer.until("error", "conversation.item.added", timeout=TIMEOUT)
    assert event["type"] == "error", event
    assert not any(e["type"] == "conversation.item.added" for e in before)
    return event["error"]


def without(text: str, digest: str) -> str:
    return text.replace(digest, "<digest>")


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Settings for an in-process gateway, or one whose stores live in a real redis-server."""
    if request.param == "memory":
        return {}
    return {"redis_url": request.getfixturevalue("redis_url")}


# ------------------------------------------------------------------ references and probes


async def test_another_keys_digest_reads_as_unknown_on_websocket_and_http(
    make_gateway: GatewayFactory, backend: dict[str, Any]
) -> None:
    gw = make_gateway(settings=dict(api_keys=KEYS, **backend))
    photo = unique_photo()
    digest = hashlib.sha256(photo).hexdigest()
    unknown = secrets.token_hex(32)
    async with peer_for(gw, "ka") as a:
        encoded = await send_image(a, data_url(photo))
        assert encoded["digest"] == digest and encoded["cache"] == "miss"

    async with peer_for(gw, "kb") as b:
        foreign = await refused_reference(b, digest)
        never = await refused_reference(b, unknown)
        assert foreign["code"] == never["code"] == "image_not_found"
        assert foreign["param"] == never["param"] == "item.content[0].image_url"
        assert without(foreign["message"], digest) == without(never["message"], unknown)
        session_id = b.session_id
    async with http_for(gw, "kb") as client:
        view = (await client.get(f"/v1/sessions/{session_id}")).json()
        assert view["items"] == [] and view["images"] == []  # nothing of B's tries was kept
        foreign_http = await client.post(
            "/v1/chat/completions", json=chat_body(f"visiongate:sha256:{digest}")
        )
        never_http = await client.post(
            "/v1/chat/completions", json=chat_body(f"visiongate:sha256:{unknown}")
        )
    assert foreign_http.status_code == never_http.status_code == 404
    f_err, n_err = foreign_http.json()["error"], never_http.json()["error"]
    assert f_err["code"] == n_err["code"] == "image_not_found"
    assert without(f_err["message"], digest) == without(n_err["message"], unknown)
    assert f_err["param"] == n_err["param"]

    # the key that sent it references it freely, on both transports, from the cache
    async with peer_for(gw, "ka") as a:
        again = await send_image(a, f"visiongate:sha256:{digest}")
        assert again["cache"] == "hit" and again["encode_ms"] == 0.0
    async with http_for(gw, "ka") as client:
        ok = await client.post(
            "/v1/chat/completions", json=chat_body(f"visiongate:sha256:{digest}")
        )
    assert ok.status_code == 200, ok.text
    assert ok.json()["visiongate"]["cache"]["vision"] == "hit"
    assert gw.encoder.encoded.count(digest) == 1


async def test_image_status_is_visible_to_the_uploading_key_only(
    make_gateway: GatewayFactory, backend: dict[str, Any]
) -> None:
    gw = make_gateway(settings=dict(api_keys=KEYS, **backend))
    photo = unique_photo()
    digest = hashlib.sha256(photo).hexdigest()
    unknown = secrets.token_hex(32)
    headers = {"Content-Type": "image/jpeg"}
    async with http_for(gw, "ka") as a, http_for(gw, "kb") as b:
        uploaded = await a.post("/v1/images", content=photo, headers=headers)
        assert uploaded.status_code == 200, uploaded.text
        assert uploaded.json()["id"] == digest

        async def ready() -> dict[str, Any]:
            async with asyncio.timeout(TIMEOUT):
                while True:
                    r = await a.get(f"/v1/images/{digest}")
                    assert r.status_code == 200, r.text
                    if r.json()["status"] == "ready":
                        return r.json()
                    await asyncio.sleep(0.02)

        assert (await ready())["tokens_kept"] == gw.encoder.tokens
        foreign = await b.get(f"/v1/images/{digest}")
        never = await b.get(f"/v1/images/{unknown}")
        assert foreign.status_code == never.status_code == 404
        assert foreign.json()["error"]["code"] == never.json()["error"]["code"] == "image_not_found"
        assert without(foreign.text, digest) == without(never.text, unknown)
        assert (await a.get(f"/v1/images/visiongate:sha256:{digest}")).status_code == 200


# ------------------------------------------------------------------ a shared encode, unobservable


async def test_same_bytes_from_another_key_are_its_own_miss_then_its_hits(
    make_gateway: GatewayFactory, backend: dict[str, Any]
) -> None:
    gw = make_gateway(
        encoder=FakeEncoder(delay_s=ENCODE_S), settings=dict(api_keys=KEYS, **backend)
    )
    photo = unique_photo()
    digest = hashlib.sha256(photo).hexdigest()
    async with peer_for(gw, "ka") as a:
        first = await send_image(a, data_url(photo))
    assert first["cache"] == "miss" and first["encode_ms"] >= ENCODE_S * 1e3

    async with peer_for(gw, "kb") as b:
        t0 = time.perf_counter()
        theirs = await send_image(b, data_url(photo))
        took = time.perf_counter() - t0
        # what B is told, and how long it took, are an encode's: A's stage time, no sooner
        assert theirs["cache"] == "miss"
        assert theirs["encode_ms"] == first["encode_ms"]
        assert took >= first["encode_ms"] / 1e3
        assert (theirs["tokens_kept"], theirs["tokens_total"]) == (
            first["tokens_kept"],
            first["tokens_total"],
        )
        done, before = await b.respond()
        assert done["response"]["visiongate"]["cache"]["vision"] == "miss"  # the pre-encode
        assert deltas(before).endswith("[1 images]")
        # from now on the tokens are B's own: hits
        again = await send_image(b, f"visiongate:sha256:{digest}")
        assert again["cache"] == "hit" and again["encode_ms"] == 0.0
        done, _ = await b.respond()
        assert done["response"]["visiongate"]["cache"]["vision"] == "hit"
    assert gw.encoder.encoded.count(digest) == 1  # shared underneath: one encode
    assert gw.encoder.owners == [owner_of(gw, "ka")]


async def test_same_bytes_over_http_are_the_other_keys_miss_then_hit(
    make_gateway: GatewayFactory,
) -> None:
    gw = make_gateway(encoder=FakeEncoder(delay_s=ENCODE_S), settings=dict(api_keys=KEYS))
    photo = unique_photo()
    url = data_url(photo)
    async with http_for(gw, "ka") as a, http_for(gw, "kb") as b:
        first = (await a.post("/v1/chat/completions", json=chat_body(url))).json()["visiongate"]
        assert first["cache"]["vision"] == "miss"
        assert first["timings"]["encode_ms"] >= ENCODE_S * 1e3
        theirs = (await b.post("/v1/chat/completions", json=chat_body(url))).json()["visiongate"]
        assert theirs["cache"]["vision"] == "miss"
        assert theirs["cache"]["vision_misses"] == first["cache"]["vision_misses"] == 1
        assert theirs["timings"]["encode_ms"] >= ENCODE_S * 1e3
        again = (await b.post("/v1/chat/completions", json=chat_body(url))).json()["visiongate"]
        assert again["cache"]["vision"] == "hit" and again["timings"]["encode_ms"] == 0.0
    assert len(gw.encoder.encoded) == 1


async def test_concurrent_first_uses_by_two_keys_both_take_an_encodes_time(
    make_gateway: GatewayFactory,
) -> None:
    """B asks while A's encode is still running: it joins that encode, and still waits the
    whole stage time from its own start, as an encode of its own would take."""
    gw = make_gateway(encoder=FakeEncoder(delay_s=ENCODE_S), settings=dict(api_keys=KEYS))
    photo = unique_photo()
    url = data_url(photo)
    async with http_for(gw, "ka") as a, http_for(gw, "kb") as b:

        async def timed(client: httpx.AsyncClient, delay: float) -> tuple[dict[str, Any], float]:
            await asyncio.sleep(delay)
            t0 = time.perf_counter()
            r = await client.post("/v1/chat/completions", json=chat_body(url))
            assert r.status_code == 200, r.text
            return r.json()["visiongate"], time.perf_counter() - t0

        (ext_a, _), (ext_b, took_b) = await asyncio.gather(timed(a, 0.0), timed(b, ENCODE_S / 2))
    assert ext_a["cache"]["vision"] == ext_b["cache"]["vision"] == "miss"
    assert took_b >= ENCODE_S and ext_b["timings"]["encode_ms"] >= ENCODE_S * 1e3
    assert len(gw.encoder.encoded) == 1


async def test_without_sharing_every_key_encodes_its_own_images(
    make_gateway: GatewayFactory, backend: dict[str, Any]
) -> None:
    gw = make_gateway(
        settings=dict(api_keys=KEYS, share_encodes_across_keys=False, **backend),
        encoder=FakeEncoder(delay_s=0.01),
    )
    photo = unique_photo()
    digest = hashlib.sha256(photo).hexdigest()
    async with peer_for(gw, "ka") as a:
        assert (await send_image(a, data_url(photo)))["cache"] == "miss"
    async with peer_for(gw, "kb") as b:
        assert (await refused_reference(b, digest))["code"] == "image_not_found"
        assert (await send_image(b, data_url(photo)))["cache"] == "miss"
        done, _ = await b.respond()
        assert done["response"]["visiongate"]["cache"]["vision"] == "miss"
        assert (await send_image(b, f"visiongate:sha256:{digest}"))["cache"] == "hit"
    async with peer_for(gw, "ka") as a:
        assert (await send_image(a, f"visiongate:sha256:{digest}"))["cache"] == "hit"
    assert gw.encoder.encoded == [digest, digest]  # once per key, never again
    assert gw.encoder.owners == [owner_of(gw, "ka"), owner_of(gw, "kb")]


# ------------------------------------------------------------------ across replicas (Redis)


async def test_ownership_holds_across_replicas_sharing_redis(
    make_gateway: GatewayFactory, redis_url: str, raw_redis
) -> None:
    settings = dict(api_keys=KEYS, redis_url=redis_url, vision_cache_ttl_s=600)
    one = make_gateway(settings=settings)
    two = make_gateway(settings=settings)
    photo = unique_photo()
    digest = hashlib.sha256(photo).hexdigest()
    async with peer_for(one, "ka") as a:
        await send_image(a, data_url(photo))
    # the index entry is in Redis, with the vision cache's TTL
    ttl_ms = raw_redis.pttl(owner_key(owner_of(one, "ka"), digest))
    assert 0 < ttl_ms <= 600_000
    assert raw_redis.get(owner_key(owner_of(one, "ka"), digest)) == b"used"
    assert raw_redis.exists(owner_key(owner_of(one, "kb"), digest)) == 0

    async with peer_for(two, "kb") as b:
        assert (await refused_reference(b, digest))["code"] == "image_not_found"
    async with peer_for(two, "ka") as a:
        again = await send_image(a, f"visiongate:sha256:{digest}")
        assert again["cache"] == "hit"  # A's tokens, from Redis, on the other replica
    assert two.encoder.encoded == [] and one.encoder.encoded == [digest]


# ------------------------------------------------------------------ the index on its own


async def test_memory_index_is_bounded_per_owner_and_in_total() -> None:
    index = MemoryOwnerIndex(max_per_owner=3, max_entries=5)
    digests = [f"{i:064x}" for i in range(8)]
    for d in digests[:4]:
        await index.add("a", d)
    assert await index.state("a", digests[0]) is None  # the owner's least recent went
    assert [await index.state("a", d) for d in digests[1:4]] == ["sent"] * 3
    await index.mark_used("a", digests[1])
    await index.add("a", digests[1])  # sending again keeps "used"
    assert await index.state("a", digests[1]) == "used"
    for d in digests[4:7]:
        await index.add("b", d)
    assert len(index) == 5
    # "a" was least recently active: its oldest entry made room for "b"
    assert await index.state("a", digests[2]) is None
    assert await index.state("b", digests[4]) == "sent"
    assert await index.state("b", digests[0]) is None  # never sent by b


async def test_redis_index_refreshes_and_restores_entries(redis_url: str, raw_redis) -> None:
    tier = RedisTier(redis_url, tier="images")
    index = RedisOwnerIndex(MemoryOwnerIndex(), tier, ttl_s=30)
    digest = "ab" * 32
    try:
        await index.add("key_a", digest)
        key = owner_key("key_a", digest)
        assert raw_redis.get(key) == b"sent" and 0 < raw_redis.pttl(key) <= 30_000
        raw_redis.pexpire(key, 5_000)
        assert await index.state("key_a", digest) == "sent"
        assert raw_redis.pttl(key) > 5_000  # a lookup restarts the TTL
        await index.mark_used("key_a", digest)
        assert raw_redis.get(key) == b"used"
        raw_redis.delete(key)  # lost in Redis, remembered here: written back
        assert await index.state("key_a", digest) == "used"
        assert raw_redis.get(key) == b"used"
        # what another replica wrote is seen here
        other = RedisOwnerIndex(MemoryOwnerIndex(), tier, ttl_s=30)
        assert await other.state("key_a", digest) == "used"
        assert await other.state("key_b", digest) is None
    finally:
        await tier.aclose()


@pytest.mark.parametrize("tier", ["memory", "redis"])
async def test_image_store_scopes_keep_each_owners_copy_apart(
    tier: str, request: pytest.FixtureRequest
) -> None:
    redis_url = request.getfixturevalue("redis_url") if tier == "redis" else None
    store = make_image_store(redis_url, 1 << 20, 60)
    photo = unique_photo()
    digest = hashlib.sha256(photo).hexdigest()
    try:
        await store.put(digest, photo, scope="key_a")
        assert await store.get(digest, scope="key_a") == photo
        assert await store.contains(digest, scope="key_a")
        for scope in (None, "key_b"):
            assert await store.get(digest, scope=scope) is None
            assert not await store.contains(digest, scope=scope)
        with pytest.raises(ValueError):  # scoped or not, the bytes must hash to the digest
            await store.put(digest, photo + b"x", scope="key_a")
        if redis_url is not None:
            import redis

            raw = redis.Redis.from_url(redis_url)
            try:
                assert raw.get(image_key(scoped_digest("key_a", digest))) == photo
                assert raw.exists(image_key(digest)) == 0
            finally:
                raw.close()
    finally:
        await store.aclose()


class RemoteFakeEncoder(FakeEncoder):
    """Like an encoder whose workers write the shared vision cache themselves (these do not)."""

    remote = True


async def test_resolver_keeps_unshared_tokens_under_the_owners_name() -> None:
    cache, images = make_vision_cache(None, 1 << 20, 60), make_image_store(None, 1 << 20, 60)
    encoder = RemoteFakeEncoder()
    vision = VisionResolver(encoder, cache, images, share_across_keys=False)
    photo = unique_photo()
    digest = hashlib.sha256(photo).hexdigest()
    with pytest.raises(GatewayError) as caught:
        await vision.resolve("key_a", digest)
    assert caught.value.code == "image_not_found"
    await vision.add("key_a", digest, photo)
    assert (await vision.resolve("key_a", digest)).source == "encoded"
    # a remote worker writes the digest's entry; the per-owner one is the gateway's to write
    assert await cache.get(encoder.fingerprint, scoped_digest("key_a", digest)) is not None
    assert await cache.get(encoder.fingerprint, digest) is None
    assert (await vision.resolve("key_a", digest)).source == "memory"
    with pytest.raises(GatewayError) as caught:
        await vision.resolve("key_b", digest)  # cached, but not key_b's
    assert caught.value.code == "image_not_found"
    assert not await vision.known("key_b", digest) and await vision.cached("key_b", digest) is None
    assert encoder.encoded == [digest] and encoder.owners == ["key_a"]


async def test_a_reference_is_checked_before_any_cache_is_touched(
    make_gateway: GatewayFactory,
) -> None:
    """Another key's digest takes the unknown digest's path: the ownership lookup refuses it
    and the vision cache is never asked (so no hit or miss of it is ever counted)."""
    gw = make_gateway(settings=dict(api_keys=KEYS))
    photo = unique_photo()
    digest = hashlib.sha256(photo).hexdigest()
    async with peer_for(gw, "ka") as a:
        await send_image(a, data_url(photo))
    cache = gw.state.vision_cache
    before = await cache.stats()
    async with peer_for(gw, "kb") as b:
        await refused_reference(b, digest)
        await refused_reference(b, secrets.token_hex(32))
    after = await cache.stats()
    assert (after.memory_hits, after.memory_misses) == (before.memory_hits, before.memory_misses)
