"""Faults and races over the real server: an encoder that fails or hangs, items added while an
answer streams, two connections writing one session, oversized input, bad sampling values."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.chat.service import kv_key_for
from gateway.testing.realtime_peer import Peer, data_url, deltas
from tests.gateway.caching.test_session_cache import fresh_image
from tests.gateway.conftest import gateway_state

pytestmark = pytest.mark.slow


@pytest.fixture
def faulty_encoder(gateway_server):
    """Makes the real encoder of the shared gateway fail or stall for chosen images (fault
    injection around the real component, undone after the test)."""
    encoder = gateway_state(gateway_server).require().encoder
    real = encoder.encode
    faults: dict[bytes, str] = {}

    async def encode(data: bytes, **kwargs):
        fault = faults.get(data)
        if fault == "crash":
            await asyncio.sleep(1.0)  # fails while a response is waiting for it
            raise RuntimeError("device lost")
        if fault == "stall":
            await asyncio.sleep(5.0)
        return await real(data, **kwargs)

    encoder.encode = encode
    yield faults
    encoder.encode = real


async def test_encoder_crash_ends_the_response_as_failed(gateway_server, faulty_encoder) -> None:
    image = fresh_image(21)
    faulty_encoder[image] = "crash"
    peer = await Peer.open(gateway_server.ws_url)
    await peer.add(
        [
            {"type": "input_image", "image_url": data_url(image, "image/png")},
            {"type": "input_text", "text": "What is this?"},
        ],
        event_id="item",
    )
    await peer.send({"type": "response.create", "event_id": "go"})
    done, seen = await peer.until("response.done", timeout=60)
    assert done["response"]["status"] == "failed"
    assert done["response"]["status_details"]["error"]["code"] == "internal_error"
    codes = {(e["error"]["code"], e["error"]["event_id"]) for e in seen if e["type"] == "error"}
    assert ("internal_error", "go") in codes
    # the connection carries on, and the failed image's item left the conversation
    await peer.add([{"type": "input_text", "text": "Hello?"}])
    done, _ = await peer.respond(max_output_tokens=2)
    assert done["response"]["status"] in ("completed", "incomplete")
    assert done["response"]["usage"]["input_token_details"]["image_tokens"] == 0
    await peer.close()


async def test_cancel_while_waiting_for_an_encode(gateway_server, faulty_encoder) -> None:
    image = fresh_image(22)
    faulty_encoder[image] = "stall"
    peer = await Peer.open(gateway_server.ws_url)
    await peer.add(
        [
            {"type": "input_image", "image_url": data_url(image, "image/png")},
            {"type": "input_text", "text": "What is this?"},
        ]
    )
    await peer.send({"type": "response.create"})
    await peer.until("response.created")
    t0 = time.perf_counter()
    await peer.send({"type": "response.cancel"})
    done, _ = await peer.until("response.done")
    assert done["response"]["status"] == "cancelled"
    assert time.perf_counter() - t0 < 3.0  # not held for the 5 s encode
    await peer.close()


async def test_items_added_while_an_answer_streams_come_after_it(gateway_server) -> None:
    peer = await Peer.open(gateway_server.ws_url)
    await peer.add([{"type": "input_text", "text": "Name a colour."}])
    await peer.send({"type": "response.create", "response": {"max_output_tokens": 12}})
    await peer.until("response.output_text.delta")
    await peer.add([{"type": "input_text", "text": "Name a fruit."}])  # typed while A1 streams
    done1, _ = await peer.until("response.done")
    done2, _ = await peer.respond(max_output_tokens=4)
    session_id = peer.session_id
    await peer.close()
    again = await Peer.open(gateway_server.ws_url, session_id)
    items = again.created["session"]["visiongate"]["items"]
    assert [(i["role"], i["content"][0]["text"]) for i in items] == [
        ("user", "Name a colour."),
        ("assistant", done1["response"]["output"][0]["content"][0]["text"]),
        ("user", "Name a fruit."),
        ("assistant", done2["response"]["output"][0]["content"][0]["text"]),
    ]
    await again.close()


async def test_two_connections_on_one_session_lose_nothing(gateway_server) -> None:
    a = await Peer.open(gateway_server.ws_url)
    b = await Peer.open(gateway_server.ws_url, a.session_id)
    await b.add([{"type": "input_text", "text": "from b"}])
    await b.until("conversation.item.done")
    await a.add([{"type": "input_text", "text": "from a"}])  # a's copy predates b's item
    await a.until("conversation.item.done")
    await a.send({"type": "session.update", "session": {"instructions": "Be brief."}})
    await a.until("session.updated")
    await a.close()
    await b.close()
    c = await Peer.open(gateway_server.ws_url, a.session_id)
    texts = [i["content"][0]["text"] for i in c.created["session"]["visiongate"]["items"]]
    assert texts == ["from b", "from a"]
    assert c.created["session"]["instructions"] == "Be brief."
    await c.close()


async def test_oversized_text_and_bad_sampling_values_are_refused(gateway_server) -> None:
    limit = gateway_state(gateway_server).settings.max_text_chars
    peer = await Peer.open(gateway_server.ws_url)
    cases = [
        (
            {
                "type": "conversation.item.create",
                "event_id": "big",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "x" * (limit + 1)}],
                },
            },
            "input_too_large",
        ),
        (
            {"type": "response.create", "event_id": "p0", "response": {"top_p": 0}},
            "invalid_request",
        ),
        (
            {"type": "response.create", "event_id": "s-", "response": {"seed": -1}},
            "invalid_request",
        ),
        (
            {"type": "session.update", "event_id": "t9", "session": {"temperature": 9}},
            "invalid_request",
        ),
        (
            {"type": "response.create", "event_id": "in", "response": {"input": []}},
            "invalid_request",
        ),
        (
            {
                "type": "response.create",
                "event_id": "tl",
                "response": {"tools": [{"type": "mcp", "server_label": "f"}]},  # not run here
            },
            "invalid_request",
        ),
    ]
    for frame, code in cases:
        await peer.send(frame)
        event = await peer.recv()
        assert event["type"] == "error" and event["error"]["code"] == code, event
        assert event["error"]["event_id"] == frame["event_id"]
    await peer.add([{"type": "input_text", "text": "ok?"}])
    done, before = await peer.respond(max_output_tokens=2)
    assert deltas(before) == done["response"]["output"][0]["content"][0]["text"]
    await peer.close()


def test_kv_is_namespaced_by_owner() -> None:
    assert kv_key_for("key_a", "support") != kv_key_for("key_b", "support")
    assert kv_key_for("key_a", "support") == kv_key_for("key_a", "support")
