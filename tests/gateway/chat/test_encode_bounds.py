"""Encoding is bounded and fair between API keys.

Caps on pending (started, not finished) encodes per WebSocket connection and per key across
connections and HTTP: past either, the item, request or upload is refused with `rate_limited`
(HTTP 429 with Retry-After) and nothing of it is kept. The in-process encoder takes waiting
images round-robin by owner, so one key's many images do not hold up another key's one.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import threading
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import pytest
import torch
from PIL import Image

from encoder_worker.config import EncoderConfig
from encoder_worker.local_encoder import EncodeJobQueue, LocalEncoder
from encoder_worker.payload import float_tokens
from encoder_worker.types import EncodedImage
from gateway.testing.fake_gateway import FakeGateway, GatewayFactory, eventually
from gateway.testing.fakes import FakeEncoder
from gateway.testing.realtime_peer import Peer, data_url
from tests.conftest import unique_photo

TIMEOUT = 10.0
MODEL = "fake-echo"


def peer_for(gateway: FakeGateway, key: str | None = None) -> AbstractAsyncContextManager[Peer]:
    """A Realtime peer on subprotocol `realtime`, with `key` (if any) in a subprotocol too."""
    return Peer.connected(gateway.ws_url, api_key=key, subprotocols=["realtime"])


def headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def add_image(peer: Peer, photo: bytes) -> dict[str, Any]:
    """Add an item with one image: `conversation.item.added`, or the `error` refusing it."""
    await peer.add([{"type": "input_image", "image_url": data_url(photo)}])
    event, _ = await peer.until("conversation.item.added", "error", timeout=TIMEOUT)
    return event


async def items_of(gateway: FakeGateway, session_id: str, key: str | None = None) -> list[Any]:
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=TIMEOUT) as client:
        r = await client.get(f"/v1/sessions/{session_id}", headers=headers(key))
    assert r.status_code == 200, r.text
    return r.json()["items"]


async def kept(gateway: FakeGateway, owner: str, photo: bytes) -> bool:
    """Whether anything of the image is held for `owner`: bytes or an ownership entry."""
    digest = hashlib.sha256(photo).hexdigest()
    images = gateway.state.images  # the in-process stores: plain dicts, safe to read here
    return await images.contains(digest) or await images.owners.state(owner, digest) is not None


def refused(event: dict[str, Any]) -> bool:
    return event["type"] == "error" and event["error"]["code"] == "rate_limited"


# ------------------------------------------------------------------ caps


async def test_a_connection_past_its_cap_is_refused_and_nothing_is_kept(
    make_gateway: GatewayFactory,
) -> None:
    gate = threading.Event()  # encodes hold until it is set
    gw = make_gateway(
        encoder=FakeEncoder(gate=gate), settings=dict(max_pending_encodes_per_connection=2)
    )
    photos = [unique_photo() for _ in range(4)]
    try:
        async with peer_for(gw) as peer:
            assert (await add_image(peer, photos[0]))["type"] == "conversation.item.added"
            assert (await add_image(peer, photos[1]))["type"] == "conversation.item.added"
            third = await add_image(peer, photos[2])
            assert refused(third), third
            assert "this connection" in third["error"]["message"]
            assert len(await items_of(gw, peer.session_id)) == 2
            assert not await kept(gw, "anonymous", photos[2])
            # another connection of the same key has its own allowance
            async with peer_for(gw) as other:
                assert (await add_image(other, photos[2]))["type"] == "conversation.item.added"
            # finished encodes free their slots
            gate.set()
            await eventually(lambda: len(gw.encoder.encoded) == 3)
            await peer.until("conversation.item.done", timeout=TIMEOUT)
            await peer.until("conversation.item.done", timeout=TIMEOUT)
            assert (await add_image(peer, photos[3]))["type"] == "conversation.item.added"
            assert len(await items_of(gw, peer.session_id)) == 3
    finally:
        gate.set()


async def test_a_key_past_its_cap_is_refused_on_every_transport(
    make_gateway: GatewayFactory,
) -> None:
    gate = threading.Event()
    gw = make_gateway(
        encoder=FakeEncoder(gate=gate),
        settings=dict(api_keys=["ka", "kb"], max_pending_encodes_per_key=2),
    )
    photos = [unique_photo() for _ in range(6)]
    owner_a = gw.state.auth.owner({"authorization": "Bearer ka"})
    try:
        async with peer_for(gw, "ka") as one, peer_for(gw, "ka") as two:
            assert (await add_image(one, photos[0]))["type"] == "conversation.item.added"
            assert (await add_image(two, photos[1]))["type"] == "conversation.item.added"
            # the key's two slots are taken, across its connections
            third = await add_image(one, photos[2])
            assert refused(third) and "this API key" in third["error"]["message"]
            assert len(await items_of(gw, one.session_id, "ka")) == 1
            assert not await kept(gw, owner_a, photos[2])

            async with httpx.AsyncClient(base_url=gw.http_url, timeout=TIMEOUT) as client:
                chat = await client.post(
                    "/v1/chat/completions",
                    headers=headers("ka"),
                    json={
                        "model": MODEL,
                        "messages": [
                            {
                                "role": "user",
                                "content": [
                                    {
                                        "type": "image_url",
                                        "image_url": {"url": data_url(photos[3])},
                                    },
                                    {"type": "text", "text": "what is it"},
                                ],
                            }
                        ],
                    },
                )
                assert chat.status_code == 429, chat.text
                assert chat.json()["error"]["code"] == "rate_limited"
                assert int(chat.headers["Retry-After"]) >= 1
                upload = await client.post(
                    "/v1/images",
                    headers=headers("ka") | {"Content-Type": "image/jpeg"},
                    content=photos[4],
                )
                assert upload.status_code == 429, upload.text
                assert upload.json()["error"]["code"] == "rate_limited"
                assert "Retry-After" in upload.headers
                # another key is not held up by this one's
                other = await client.post(
                    "/v1/images",
                    headers=headers("kb") | {"Content-Type": "image/jpeg"},
                    content=photos[5],
                )
                assert other.status_code == 200, other.text
            for photo in photos[3:5]:
                assert not await kept(gw, owner_a, photo)

            gate.set()
            await eventually(lambda: len(gw.encoder.encoded) == 3)
            await eventually(lambda: gw.state.require().vision.pending(owner_a) == 0)
            assert (await add_image(one, photos[2]))["type"] == "conversation.item.added"
    finally:
        gate.set()


async def test_images_the_key_already_has_take_no_slot(make_gateway: GatewayFactory) -> None:
    """An OpenAI client resends every image on every turn: images whose tokens the key already
    has are not encodes, so they never count against the cap."""
    gate = threading.Event()
    gate.set()
    gw = make_gateway(encoder=FakeEncoder(gate=gate), settings=dict(max_pending_encodes_per_key=1))
    old, new = unique_photo(), unique_photo()

    def body(*photos: bytes) -> dict[str, Any]:
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": data_url(p)}} for p in photos
        ]
        content.append({"type": "text", "text": "what are these"})
        return {"model": MODEL, "messages": [{"role": "user", "content": content}]}

    async with httpx.AsyncClient(base_url=gw.http_url, timeout=TIMEOUT) as client:
        assert (await client.post("/v1/chat/completions", json=body(old))).status_code == 200
        gate.clear()
        pending = asyncio.create_task(client.post("/v1/chat/completions", json=body(old, new)))
        await eventually(lambda: gw.encoder._waiting == 1)  # the new image is being encoded
        # the key's one slot is held by `new`; a request resending only `old` still goes through
        assert (await client.post("/v1/chat/completions", json=body(old))).status_code == 200
        refused_r = await client.post("/v1/chat/completions", json=body(unique_photo()))
        assert refused_r.status_code == 429
        gate.set()
        assert (await pending).status_code == 200


# ------------------------------------------------------------------ fairness


def tiny_png(n: int) -> bytes:
    """A small PNG of its own for each `n` (the stub pipeline never decodes it)."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (n % 256, n // 256 % 256, 99)).save(buf, format="PNG")
    return buf.getvalue()


class StubPipeline:
    """Stands in for `EncoderPipeline` on the encoder's thread: every batch waits for `hold`
    (set by the test once the queue is as it wants it), then records its images in the order
    they were encoded."""

    def __init__(self, hidden_size: int = 32, tokens: int = 4) -> None:
        self.hidden_size = hidden_size
        self.tokens = tokens
        self.hold = threading.Event()
        self.started = 0  # images in batches that have begun
        self.order: list[str] = []  # digests, in encode order
        self.batches: list[int] = []  # batch sizes
        self.batch_limit = 64  # as many as the encoder's max_batch (an accelerator's)

    def encode_batch(self, datas: list[bytes]) -> list[EncodedImage]:
        self.started += len(datas)
        if not self.hold.wait(TIMEOUT):
            raise RuntimeError("the test never released the encoder")
        self.batches.append(len(datas))
        out = []
        for data in datas:
            digest = hashlib.sha256(data).hexdigest()
            self.order.append(digest)
            embeds = torch.zeros(self.tokens, self.hidden_size)
            out.append(
                EncodedImage(
                    digest=digest,
                    fingerprint="",
                    tokens_kept=self.tokens,
                    tokens_total=self.tokens,
                    hidden_size=self.hidden_size,
                    payload=float_tokens(embeds, torch.arange(self.tokens), self.tokens, "fp32"),
                    timings_ms={"vision": 1.0, "batch_size": len(datas)},
                )
            )
        return out

    def close(self) -> None:
        self.hold.set()


class StubLocalEncoder(LocalEncoder):
    """The real `LocalEncoder` (fair queue, batching, worker thread) over a `StubPipeline`."""

    def __init__(self, pipeline: StubPipeline, max_batch: int) -> None:
        config = EncoderConfig(max_batch=max_batch, max_wait_ms=1.0)
        super().__init__(config, hidden_size=pipeline.hidden_size)
        pipeline.batch_limit = max_batch
        self.stub = pipeline

    def _build(self) -> StubPipeline:  # type: ignore[override]
        return self.stub

    def waiting_or_started(self) -> int:
        """Images queued or in a batch: read from any thread (two ints)."""
        return (self._queue.qsize() if self._queue is not None else 0) + self.stub.started


def test_fair_queue_takes_owners_in_turns() -> None:
    queue = EncodeJobQueue()
    for i in range(4):
        queue.put_nowait("a", (f"a{i}".encode(), None))  # type: ignore[arg-type]
    queue.put_nowait("b", (b"b0", None))  # type: ignore[arg-type]
    queue.put_nowait(None, (b"n0", None))  # type: ignore[arg-type]
    queue.put_nowait("b", (b"b1", None))  # type: ignore[arg-type]
    assert queue.qsize() == 7
    order = [queue.get_nowait()[0].decode() for _ in range(4)]
    assert order == ["a0", "b0", "n0", "a1"]
    queue.put_nowait("c", (b"c0", None))  # type: ignore[arg-type]  # a newcomer: one round
    order = [queue.get_nowait()[0].decode() for _ in range(4)]
    assert order == ["b1", "a2", "c0", "a3"]
    assert queue.empty()
    with pytest.raises(IndexError):
        queue.get_nowait()


async def test_local_encoder_admits_a_second_owner_before_the_first_owners_backlog() -> None:
    pipeline = StubPipeline()
    encoder = StubLocalEncoder(pipeline, max_batch=4)
    await encoder.start()
    try:
        backlog = [f"a{i}".encode() for i in range(20)]
        a_jobs = [asyncio.create_task(encoder.encode(d, owner="a")) for d in backlog]
        await eventually(lambda: encoder.waiting_or_started() == 20 and pipeline.started > 0)
        first = pipeline.started  # the batch running while the rest wait
        b_job = asyncio.create_task(encoder.encode(b"b0", owner="b"))
        await eventually(lambda: encoder.waiting_or_started() == 21)
        pipeline.hold.set()
        await asyncio.gather(*a_jobs, b_job)
    finally:
        await encoder.aclose()
    b_at = pipeline.order.index(hashlib.sha256(b"b0").hexdigest())
    # b's image goes in the batch after the running one (first in, first out: it would be last)
    assert pipeline.batches[0] == first and b_at < first + 4
    assert len(pipeline.order) == 21 and b_at < 10


async def test_one_keys_image_is_not_held_up_by_another_keys_twenty(
    make_gateway: GatewayFactory,
) -> None:
    pipeline = StubPipeline()
    encoder = StubLocalEncoder(pipeline, max_batch=4)
    gw = make_gateway(
        encoder=encoder,  # type: ignore[arg-type]
        settings=dict(
            api_keys=["ka", "kb"],
            max_images_per_session=32,
            max_pending_encodes_per_connection=32,
            max_pending_encodes_per_key=32,
        ),
    )
    a_photos = [tiny_png(n) for n in range(20)]
    b_photo = tiny_png(20)
    try:
        async with peer_for(gw, "ka") as a, peer_for(gw, "kb") as b:
            for photo in a_photos:
                await a.add([{"type": "input_image", "image_url": data_url(photo, "image/png")}])
            await eventually(lambda: encoder.waiting_or_started() == 20 and pipeline.started > 0)
            await b.add([{"type": "input_image", "image_url": data_url(b_photo, "image/png")}])
            await eventually(lambda: encoder.waiting_or_started() == 21)
            pipeline.hold.set()
            encoded, _ = await b.until("visiongate.image.encoded", timeout=TIMEOUT)
            assert encoded["cache"] == "miss"
            for _ in a_photos:
                await a.until("visiongate.image.encoded", timeout=TIMEOUT)
    finally:
        pipeline.hold.set()
    b_at = pipeline.order.index(hashlib.sha256(b_photo).hexdigest())
    assert len(pipeline.order) == 21
    # B's one image went in the second batch; most of A's twenty were encoded after it
    assert b_at < pipeline.batches[0] + 4 and 20 - b_at > 10
