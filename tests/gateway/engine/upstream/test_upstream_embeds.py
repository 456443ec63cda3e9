"""`--engine openai --upstream-images embeds` end to end: the gateway encodes with the upstream's
own checkpoint (a tiny random-weight LLaVA built with transformers' classes) and sends vLLM
`image_embeds` parts holding exactly the visual tokens its encoder made.

The replica is `gateway.testing.upstream_fake.FakeUpstream`, a scripted OpenAI-compatible server:
it stands
in for vLLM started with `--enable-mm-embeds`, which needs a GPU.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from gateway.server.app import build_encoder, create_app
from gateway.server.runner import ServerThread
from gateway.settings import Settings
from gateway.testing.realtime_peer import data_url
from gateway.testing.upstream_fake import FakeUpstream, Script, wait_until
from tests.conftest import free_port, photo_bytes
from tests.gateway.engine.upstream.test_upstream_engine import _saved_tensor_bytes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vlm_checkpoints import llava

    return llava.build(tmp_path_factory.mktemp("llava") / "tiny-llava")


def embeds_settings(checkpoint: Path, upstream: FakeUpstream) -> Settings:
    return Settings(
        engine="openai",
        upstreams=[upstream.url],
        upstream_images="embeds",
        model_path=str(checkpoint),
        pruning="none",
        visual_tokens="fp32",
        device="cpu",
        port=free_port(),
    )


async def encode_apart(settings: Settings, engine: object, photo: bytes):
    encoder = build_encoder(settings, engine)
    await encoder.start()
    try:
        return await encoder.encode(photo)
    finally:
        await encoder.aclose()


def test_the_replica_gets_the_gateways_own_visual_tokens(llava: Path) -> None:
    photo = photo_bytes("chelsea", "PNG", 96)
    digest = hashlib.sha256(photo).hexdigest()
    with FakeUpstream("org/tiny-llava") as upstream:  # the same checkpoint, by its name
        upstream.default = Script(chunks=["A", " cat."])
        settings = embeds_settings(llava, upstream)
        with ServerThread(create_app(settings), settings, port=settings.port) as server:
            server.wait_ready(timeout=120)
            client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
            done = client.chat.completions.create(
                model="org/tiny-llava",
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": data_url(photo, "image/png")},
                            },
                            {"type": "text", "text": "What is this?"},
                        ],
                    }
                ],
                max_tokens=8,
            )
            state = server.app.state["gateway"]
            fingerprint = state.require().vision.fingerprint
            # the same image through an encoder of the same settings, made apart (CPU, fp32,
            # no patch dropping: deterministic)
            encoded = asyncio.run(encode_apart(settings, state.engine, photo))
    assert done.choices[0].message.content == "A cat."
    (sent,) = upstream.chat_requests()
    user = next(m for m in sent.body["messages"] if m["role"] == "user")
    (part,) = [p for p in user["content"] if p["type"] == "image_embeds"]
    assert part["uuid"] == f"{fingerprint[:16]}:{digest}"
    assert encoded.fingerprint == fingerprint
    tokens = encoded.embeds("cpu").numpy()
    config = json.loads((llava / "config.json").read_text())
    assert tokens.shape[1] == config["text_config"]["hidden_size"]
    sent_tokens = np.frombuffer(_saved_tensor_bytes(part["image_embeds"]), dtype=np.float32)
    # exactly the encoder's tokens (serialized as float32, nothing recomputed upstream-side)
    np.testing.assert_array_equal(sent_tokens.reshape(tokens.shape), tokens)


def test_a_replica_serving_another_model_stops_the_gateway_at_start(llava: Path) -> None:
    with FakeUpstream("org/some-other-vlm") as upstream:
        settings = embeds_settings(llava, upstream)
        with ServerThread(create_app(settings), settings, port=settings.port) as server:
            url = f"{server.http_url}/readyz"
            assert wait_until(lambda: httpx.get(url).json().get("status") == "failed", 60)
            body = httpx.get(url).json()
    assert "tiny-llava" in body["error"] and "some-other-vlm" in body["error"]
    assert not upstream.chat_requests()
