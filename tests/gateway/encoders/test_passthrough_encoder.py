"""An engine that encodes images itself (it takes "bytes": an upstream sent data URLs).

The gateway still takes, checks, stores and references images as always, and keeps them private
to the key that sent them; it encodes nothing (its encoder is the pass-through one, no tower is
loaded), never waits for an encode, and hands the engine each image's bytes with a content id:
the sha256 digest, or a per-key name when images are not shared across keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from encoder_worker.storage import scoped_digest
from gateway.encoders.passthrough_encoder import PassThroughEncoder
from gateway.engine.interface import EngineCapabilities, ImageInput
from gateway.testing.fake_gateway import FakeGateway, start_gateway, unit_settings
from gateway.testing.fakes import FakeEngine
from gateway.testing.realtime_peer import data_url
from tests.conftest import photo_bytes, unique_photo
from tests.gateway.chat.test_image_privacy import chat_body, peer_for, send_image

KEYS = ["ka", "kb"]


class BytesEngine(FakeEngine):
    """The fake echo engine, taking images as bytes (as an upstream engine does)."""

    capabilities = EngineCapabilities(image_input="bytes")


@pytest.fixture
def start() -> Iterator[Any]:
    started: list[FakeGateway] = []

    def make(**settings: Any) -> FakeGateway:
        # no encoder given: the gateway builds the one an engine taking bytes needs
        gateway = start_gateway(unit_settings(api_keys=KEYS, **settings), BytesEngine(), None)
        started.append(gateway)
        return gateway

    yield make
    for gateway in started:
        gateway.server.stop()


def images_of(engine: FakeEngine) -> list[ImageInput]:
    return [
        part
        for message in engine.requests[-1].messages
        for part in message.content
        if isinstance(part, ImageInput)
    ]


async def chat(gateway: FakeGateway, key: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(
        base_url=gateway.http_url, headers={"Authorization": f"Bearer {key}"}, timeout=10
    ) as client:
        return await client.post("/v1/chat/completions", json=body)


async def test_the_engine_gets_the_bytes_and_their_digest(start: Any) -> None:
    gateway = start()
    assert isinstance(gateway.state.require().encoder, PassThroughEncoder)
    photo = unique_photo()
    response = await chat(gateway, "ka", chat_body(data_url(photo), "what is it"))
    assert response.status_code == 200, response.text
    assert "[1 images]" in response.json()["choices"][0]["message"]["content"]
    (image,) = images_of(gateway.engine)
    assert image.data == photo and image.embeds is None
    assert image.digest == hashlib.sha256(photo).hexdigest()
    assert image.mime == "image/jpeg"
    png = photo_bytes("chelsea", "PNG", 64)
    assert (await chat(gateway, "ka", chat_body(data_url(png, "image/png")))).status_code == 200
    assert images_of(gateway.engine)[0].mime == "image/png"


async def test_a_referenced_image_reaches_the_engine_and_stays_private(start: Any) -> None:
    gateway = start()
    photo = unique_photo()
    digest = hashlib.sha256(photo).hexdigest()
    async with peer_for(gateway, "ka") as peer:
        encoded = await send_image(peer, data_url(photo))
        # nothing was encoded here: the engine encodes the bytes itself
        assert encoded["digest"] == digest and encoded["tokens_kept"] == 0
    reference = chat_body(f"visiongate:sha256:{digest}")
    assert (await chat(gateway, "ka", reference)).status_code == 200
    assert images_of(gateway.engine)[0].data == photo
    seen = len(gateway.engine.requests)
    refused = await chat(gateway, "kb", reference)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "image_not_found"
    assert len(gateway.engine.requests) == seen  # another key's image never reaches the engine


async def test_content_ids_are_per_key_when_images_are_not_shared(start: Any) -> None:
    gateway = start(share_encodes_across_keys=False)
    photo = unique_photo()
    digest = hashlib.sha256(photo).hexdigest()
    ids = {}
    for key in KEYS:
        assert (await chat(gateway, key, chat_body(data_url(photo)))).status_code == 200
        (image,) = images_of(gateway.engine)
        assert image.data == photo
        ids[key] = image.digest
    owners = {key: gateway.state.auth.owner({"authorization": f"Bearer {key}"}) for key in KEYS}
    assert ids == {key: scoped_digest(owners[key], digest) for key in KEYS}
    assert len(set(ids.values())) == 2 and digest not in ids.values()
