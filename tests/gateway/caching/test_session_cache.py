"""Session-aware caching over real servers: vision cache, KV reuse, pre-encoding, Redis restart."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest

from gateway.server.app import create_app
from gateway.server.runner import ServerThread
from gateway.testing.realtime_peer import Peer, data_url, image_question
from tests.gateway.conftest import gateway_settings, gateway_state

pytestmark = pytest.mark.slow

QUESTION_1 = "What is in this photo?"
QUESTION_2 = "Give it a short title."


def fresh_image(seed: int) -> bytes:
    """A PNG no test has sent before (so the first encode is a real miss)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = (rng.random((160, 200, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


async def two_turns(url: str, image: bytes, *, session_id: str | None = None) -> list[dict]:
    peer = await Peer.open(url, session_id)
    _, first = await peer.ask(image_question(image, QUESTION_1, "image/png"), max_output_tokens=16)
    await peer.add([{"type": "input_text", "text": QUESTION_2}])
    done2, _ = await peer.respond(max_output_tokens=16)
    await peer.close()
    return [first, done2["response"]]


async def test_followup_reuses_tokens_and_kv_and_answers_the_same(
    gateway_server, uncached_server
) -> None:
    image = fresh_image(1)
    state = gateway_state(gateway_server)
    encodes_before = state.require().vision.encodes
    r1, r2 = await two_turns(gateway_server.ws_url, image)
    assert state.require().vision.encodes == encodes_before + 1  # turn 2 did not re-encode
    assert r1["visiongate"]["cache"]["vision"] == "miss"
    assert r2["visiongate"]["cache"]["vision"] == "hit"
    assert r2["visiongate"]["timings"]["encode_ms"] == 0.0
    # turn 2 prefilled only its new words: turn 1's prompt and every answer token that went
    # through the model came from KV (only the last sampled token was never fed)
    turn1_tokens = r1["usage"]["input_tokens"] + r1["usage"]["output_tokens"]
    cached = r2["usage"]["input_token_details"]["cached_tokens"]
    assert turn1_tokens - 1 <= cached < r2["usage"]["input_tokens"]
    assert r2["visiongate"]["cache"]["kv_tokens_reused"] == cached

    # the same conversation on a gateway that caches nothing gives the same greedy answers
    b1, b2 = await two_turns(uncached_server.ws_url, image)
    assert b2["usage"]["input_token_details"]["cached_tokens"] == 0
    assert b2["visiongate"]["cache"]["vision"] == "miss"
    assert b1["output"][0]["content"][0]["text"] == r1["output"][0]["content"][0]["text"]
    assert b2["output"][0]["content"][0]["text"] == r2["output"][0]["content"][0]["text"]
    assert b2["usage"]["input_tokens"] == r2["usage"]["input_tokens"]


async def test_eight_concurrent_turns_on_one_new_image_encode_once(gateway_server) -> None:
    image = fresh_image(2)
    state = gateway_state(gateway_server)
    before = state.require().vision.encodes

    async def turn() -> tuple[dict, dict]:
        peer = await Peer.open(gateway_server.ws_url)
        await peer.add(
            [
                {"type": "input_image", "image_url": data_url(image, "image/png")},
                {"type": "input_text", "text": "Describe it."},
            ]
        )
        await peer.send({"type": "response.create", "response": {"max_output_tokens": 2}})
        encoded, _ = await peer.until("visiongate.image.encoded")
        done, _ = await peer.until("response.done")
        await peer.close()
        return encoded, done["response"]

    results = await asyncio.gather(*(turn() for _ in range(8)))
    assert state.require().vision.encodes == before + 1
    digests = {encoded["digest"] for encoded, _ in results}
    assert len(digests) == 1
    kept = {r["usage"]["input_token_details"]["image_tokens"] for _, r in results}
    assert len(kept) == 1 and kept.pop() > 0
    assert all(r["status"] in ("completed", "incomplete") for _, r in results)


async def test_pre_encoding_hides_the_encode_from_the_response(gateway_server) -> None:
    # image first, question later: the response finds the tokens ready
    peer = await Peer.open(gateway_server.ws_url)
    await peer.add([{"type": "input_image", "image_url": data_url(fresh_image(3), "image/png")}])
    await peer.until("visiongate.image.encoded")
    await peer.add([{"type": "input_text", "text": QUESTION_1}])
    done, _ = await peer.respond(max_output_tokens=2)
    assert done["response"]["visiongate"]["timings"]["encode_ms"] == 0.0
    assert done["response"]["visiongate"]["cache"]["vision"] == "miss"
    await peer.close()

    # image and question together: the response waits for the encode
    peer = await Peer.open(gateway_server.ws_url)
    await peer.add(
        [
            {"type": "input_image", "image_url": data_url(fresh_image(4), "image/png")},
            {"type": "input_text", "text": QUESTION_1},
        ]
    )
    done, _ = await peer.respond(max_output_tokens=2)
    assert done["response"]["visiongate"]["timings"]["encode_ms"] > 0.0
    await peer.close()


async def test_image_reference_by_digest(gateway_server) -> None:
    image = fresh_image(5)
    peer = await Peer.open(gateway_server.ws_url)
    await peer.add([{"type": "input_image", "image_url": data_url(image, "image/png")}])
    encoded, _ = await peer.until("visiongate.image.encoded")
    await peer.close()
    other = await Peer.open(gateway_server.ws_url)
    await other.add(
        [
            {"type": "input_image", "image_url": f"visiongate:sha256:{encoded['digest']}"},
            {"type": "input_text", "text": QUESTION_1},
        ]
    )
    again, _ = await other.until("visiongate.image.encoded")
    assert again["cache"] == "hit" and again["encode_ms"] == 0.0
    assert again["tokens_kept"] == encoded["tokens_kept"]
    await other.close()


async def test_restart_on_the_same_redis_resumes_without_re_encoding(redis_url: str) -> None:
    image = fresh_image(6)
    settings = gateway_settings(redis_url=redis_url)
    with ServerThread(create_app(settings), settings) as a:
        a.wait_ready()
        peer = await Peer.open(a.ws_url)
        session_id = peer.session_id
        await peer.add(
            [
                {"type": "input_image", "image_url": data_url(image, "image/png")},
                {"type": "input_text", "text": QUESTION_1},
            ]
        )
        await peer.until("conversation.item.done")
        done1, _ = await peer.respond(max_output_tokens=12)
        answer1 = done1["response"]["output"][0]["content"][0]["text"]
        await peer.close()
    # gateway A is gone; B shares nothing with it but Redis
    with ServerThread(create_app(settings), settings) as b:
        b.wait_ready()
        peer = await Peer.open(b.ws_url, session_id)
        history = peer.created["session"]["visiongate"]["items"]
        assert [i["role"] for i in history] == ["user", "assistant"]
        assert history[1]["content"][0]["text"] == answer1
        await peer.add([{"type": "input_text", "text": QUESTION_2}])
        done2, _ = await peer.respond(max_output_tokens=12)
        r2 = done2["response"]
        assert r2["visiongate"]["cache"]["vision"] == "hit"
        assert r2["visiongate"]["timings"]["encode_ms"] == 0.0
        assert gateway_state(b).require().vision.encodes == 0
        # KV blocks came back from Redis too: turn 1 is not prefilled again
        turn1 = done1["response"]["usage"]
        assert (
            r2["usage"]["input_token_details"]["cached_tokens"]
            >= turn1["input_tokens"] + turn1["output_tokens"] - 1
        )
        await peer.close()
