"""`/v1/realtime` through the real app and a real `websockets` client: over the fake engine and
encoder, the event sequence, images, cancel, resume, the msgpack codec, loading; then (marked
slow) over a real server, the real engine and the real encoder, with the SDK and the official
`openai` Realtime client."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import threading
from typing import Any

import httpx
import msgspec
import pytest
import websockets

from gateway.protocol.subprotocols import MSGPACK_SUBPROTOCOL
from gateway.testing.fake_gateway import FakeGateway, GatewayFactory, eventually
from gateway.testing.fakes import FakeEncoder, FakeEngine
from gateway.testing.realtime_peer import Peer, data_url, deltas
from tests.conftest import photo_bytes, unique_photo

TIMEOUT = 10.0  # a hang fails the test instead of stalling the suite
RESPONSE_EVENTS = [
    "response.created",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def collapse(types: list[str]) -> list[str]:
    """Event types with runs of one type (the deltas) collapsed to one entry."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


async def session_view(gateway: FakeGateway, session_id: str) -> dict[str, Any]:
    """The session as `GET /v1/sessions/{id}` shows it."""
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=TIMEOUT) as client:
        r = await client.get(f"/v1/sessions/{session_id}")
    assert r.status_code == 200, r.text
    return r.json()


def engine_request(gateway: FakeGateway, response_id: str):
    return next(r for r in gateway.engine.requests if r.request_id == response_id)


async def test_session_created_describes_a_new_session(fake_gateway: FakeGateway) -> None:
    peer = await Peer.open(fake_gateway.ws_url)
    try:
        created = peer.created
        assert created["type"] == "session.created" and created["event_id"]
        session = created["session"]
        assert session["id"].startswith("sess_") and session["model"] == "fake-echo"
        assert session["instructions"] == fake_gateway.settings.default_instructions
        assert session["max_output_tokens"] == fake_gateway.settings.max_output_tokens
        assert session["visiongate"]["resumed"] is False
        assert session["visiongate"]["items"] == []
    finally:
        await peer.close()


async def test_text_turn_streams_deltas_then_done_with_usage(fake_gateway: FakeGateway) -> None:
    peer = await Peer.open(fake_gateway.ws_url)
    try:
        await peer.add([{"type": "input_text", "text": "name three rivers"}], event_id="c1")
        added, _ = await peer.until("conversation.item.added", timeout=TIMEOUT)
        assert added["item"]["role"] == "user" and added["item"]["id"]
        assert added["item"]["content"] == [{"type": "input_text", "text": "name three rivers"}]
        item_done, _ = await peer.until("conversation.item.done", timeout=TIMEOUT)
        assert item_done["item"]["id"] == added["item"]["id"]

        await peer.send({"type": "response.create", "event_id": "r1"})
        done, before = await peer.until("response.done", timeout=TIMEOUT)
        assert collapse([e["type"] for e in before]) == RESPONSE_EVENTS
        response = done["response"]
        text = deltas(before)
        assert response["status"] == "completed" and text.startswith("name three rivers")
        assert response["output"][0]["content"][0]["text"] == text
        assert response["output"][0]["role"] == "assistant"
        assert response["conversation_id"] == peer.session_id
        usage = response["usage"]
        assert usage["output_tokens"] == sum(
            e["type"] == "response.output_text.delta" for e in before
        )
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0
        assert usage["input_token_details"]["image_tokens"] == 0
        assert response["visiongate"]["model"] == "fake-echo"
        assert response["visiongate"]["cache"]["vision"] == "none"
        # every server event has its own id
        ids = [e["event_id"] for e in [*before, done]]
        assert len(set(ids)) == len(ids)
    finally:
        await peer.close()


async def test_session_update_applies_to_the_next_response(fake_gateway: FakeGateway) -> None:
    peer = await Peer.open(fake_gateway.ws_url)
    try:
        await peer.send(
            {
                "type": "session.update",
                "session": {
                    "instructions": "Speak like a pirate.",
                    "temperature": 0.5,
                    "seed": 7,
                    "max_output_tokens": 3,
                },
            }
        )
        updated, _ = await peer.until("session.updated", timeout=TIMEOUT)
        session = updated["session"]
        assert session["instructions"] == "Speak like a pirate."
        assert session["max_output_tokens"] == 3
        assert (session["visiongate"]["temperature"], session["visiongate"]["seed"]) == (0.5, 7)

        await peer.add([{"type": "input_text", "text": "one two three four five"}])
        await peer.until("conversation.item.done", timeout=TIMEOUT)
        done, before = await peer.respond()
        response = done["response"]
        assert response["status"] == "incomplete"
        assert response["status_details"]["reason"] == "max_output_tokens"
        assert deltas(before) == "one two three"
        request = engine_request(fake_gateway, response["id"])
        assert request.messages[0].role == "system"
        assert request.messages[0].content == ["Speak like a pirate."]
        assert (request.sampling.temperature, request.sampling.seed) == (0.5, 7)
    finally:
        await peer.close()


async def test_image_item_is_encoded_and_reaches_the_model(fake_gateway: FakeGateway) -> None:
    photo = unique_photo("astronaut")  # never sent before: a real cache miss
    digest = hashlib.sha256(photo).hexdigest()
    peer = await Peer.open(fake_gateway.ws_url)
    try:
        await peer.add(
            [
                {"type": "input_image", "image_url": data_url(photo)},
                {"type": "input_text", "text": "what is this"},
            ]
        )
        added, _ = await peer.until("conversation.item.added", timeout=TIMEOUT)
        assert added["item"]["content"][0]["image_url"] == f"visiongate:sha256:{digest}"
        encoded, _ = await peer.until("visiongate.image.encoded", timeout=TIMEOUT)
        assert (encoded["digest"], encoded["item_id"]) == (digest, added["item"]["id"])
        assert encoded["content_index"] == 0 and encoded["cache"] == "miss"
        assert encoded["tokens_kept"] == fake_gateway.encoder.tokens == encoded["tokens_total"]
        await peer.until("conversation.item.done", timeout=TIMEOUT)

        done, before = await peer.respond()
        first = done["response"]
        assert deltas(before) == "what is this [1 images]"
        assert first["usage"]["input_token_details"]["image_tokens"] == encoded["tokens_kept"]
        assert first["visiongate"]["image_tokens_total"] == encoded["tokens_total"]
        assert first["visiongate"]["cache"]["vision"] == "miss"  # the pre-encode, joined
        assert fake_gateway.encoder.encoded.count(digest) == 1

        # the next turn finds the image's tokens in the cache
        await peer.add([{"type": "input_text", "text": "and again"}])
        await peer.until("conversation.item.done", timeout=TIMEOUT)
        done, before = await peer.respond()
        second = done["response"]
        assert second["visiongate"]["cache"]["vision"] == "hit"
        assert second["usage"]["input_token_details"]["image_tokens"] == encoded["tokens_kept"]
        assert fake_gateway.encoder.encoded.count(digest) == 1

        # an image referenced by digest is the same image
        await peer.add(
            [
                {"type": "input_image", "image_url": f"visiongate:sha256:{digest}"},
                {"type": "input_text", "text": "same one"},
            ]
        )
        encoded, _ = await peer.until("visiongate.image.encoded", timeout=TIMEOUT)
        assert encoded["cache"] == "hit" and encoded["digest"] == digest
    finally:
        await peer.close()


async def test_bad_image_is_refused_at_item_create(fake_gateway: FakeGateway) -> None:
    peer = await Peer.open(fake_gateway.ws_url)
    try:
        await peer.add(
            [{"type": "input_image", "image_url": data_url(b"plain text, not pixels")}],
            event_id="img1",
        )
        error = await peer.recv(TIMEOUT)
        assert error["type"] == "error" and error["error"]["event_id"] == "img1"
        assert error["error"]["code"] == "invalid_image"
        # nothing was added to the conversation
        await peer.add([{"type": "input_text", "text": "still here"}])
        added, _ = await peer.until("conversation.item.added", timeout=TIMEOUT)
        assert added["previous_item_id"] is None
    finally:
        await peer.close()


async def test_response_cancel_ends_cancelled_and_keeps_the_partial_answer(
    make_gateway: GatewayFactory,
) -> None:
    gateway = make_gateway(engine=FakeEngine(delay_s=0.05))
    peer = await Peer.open(gateway.ws_url)
    try:
        await peer.add([{"type": "input_text", "text": " ".join(f"w{i}" for i in range(50))}])
        await peer.until("conversation.item.done", timeout=TIMEOUT)
        await peer.send({"type": "response.create"})
        first, _ = await peer.until("response.output_text.delta", timeout=TIMEOUT)
        # one response at a time
        await peer.send({"type": "response.create", "event_id": "again"})
        busy, between = await peer.until("error", timeout=TIMEOUT)
        assert busy["error"]["code"] == "response_in_progress"
        assert busy["error"]["event_id"] == "again"
        await peer.send({"type": "response.cancel", "event_id": "stop"})
        done, before = await peer.until("response.done", timeout=TIMEOUT)
        response = done["response"]
        assert response["status"] == "cancelled"
        assert response["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
        text = first["delta"] + deltas(between) + deltas(before)
        assert text == response["output"][0]["content"][0]["text"]
        assert 0 < response["usage"]["output_tokens"] < 50
        assert response["output"][0]["status"] == "incomplete"

        # the session keeps the partial answer as incomplete; the connection carries on
        stored = await session_view(gateway, peer.session_id)
        answer = stored["items"][-1]
        assert (answer["role"], answer["status"]) == ("assistant", "incomplete")
        assert answer["content"] == [{"type": "text", "text": text}]
        await peer.send({"type": "response.cancel", "event_id": "late"})
        late = await peer.recv(TIMEOUT)
        assert late["error"]["code"] == "response_not_found"
        done, _ = await peer.respond(max_output_tokens=2)
        assert done["response"]["status"] == "incomplete"
    finally:
        await peer.close()


async def test_resume_with_session_id_continues_the_conversation(
    fake_gateway: FakeGateway,
) -> None:
    first = await Peer.open(fake_gateway.ws_url)
    try:
        await first.add([{"type": "input_text", "text": "remember the blue door"}])
        user, _ = await first.until("conversation.item.done", timeout=TIMEOUT)
        done, _ = await first.respond()
        answer = done["response"]["output"][0]
    finally:
        await first.close()

    second = await Peer.open(fake_gateway.ws_url, session_id=first.session_id)
    try:
        session = second.created["session"]
        assert session["id"] == first.session_id
        assert session["visiongate"]["resumed"] is True
        items = session["visiongate"]["items"]
        assert [i["id"] for i in items] == [user["item"]["id"], answer["id"]]
        assert items[1]["content"][0]["text"] == answer["content"][0]["text"]
        # what the stored conversation has cost so far: the first response's usage
        usage = done["response"]["usage"]
        assert session["visiongate"]["usage"] == {
            "responses": 1,
            "input_tokens": usage["input_tokens"],
            "output_tokens": usage["output_tokens"],
        }
        await second.add([{"type": "input_text", "text": "which door"}])
        added, _ = await second.until("conversation.item.added", timeout=TIMEOUT)
        assert added["previous_item_id"] == answer["id"]
        done, _ = await second.respond()
        # the model saw the whole conversation: question, answer, question
        request = engine_request(fake_gateway, done["response"]["id"])
        assert [m.role for m in request.messages] == ["user", "assistant", "user"]
    finally:
        await second.close()


async def test_resume_unknown_session_is_an_error_then_close(fake_gateway: FakeGateway) -> None:
    async with websockets.connect(f"{fake_gateway.ws_url}?session_id=sess_nope") as ws:
        error = msgspec.json.decode(await ws.recv())
        assert error["type"] == "error" and error["error"]["code"] == "session_not_found"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


async def test_unknown_event_and_malformed_json_get_error_events(
    fake_gateway: FakeGateway,
) -> None:
    peer = await Peer.open(fake_gateway.ws_url)
    try:
        await peer.send('{"type": "conversation.delete_everything", "event_id": "e1"}')
        error = await peer.recv(TIMEOUT)
        assert error["type"] == "error"
        assert (error["error"]["code"], error["error"]["event_id"]) == ("unknown_event", "e1")
        assert error["error"]["param"] == "type"
        await peer.send("{not json")
        error = await peer.recv(TIMEOUT)
        assert error["type"] == "error" and error["error"]["code"] == "invalid_json"
        assert error["error"]["event_id"] is None
        # the connection stays open and in order
        await peer.send({"type": "session.update", "session": {"instructions": "Still here."}})
        updated = await peer.recv(TIMEOUT)
        assert updated["type"] == "session.updated"
        assert updated["session"]["instructions"] == "Still here."
    finally:
        await peer.close()


class MsgpackPeer:
    """A client on the msgpack subprotocol: binary frames both ways."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(msgspec.msgpack.encode(event))

    async def recv(self) -> dict[str, Any]:
        frame = await self.ws.recv()
        assert isinstance(frame, bytes), "a msgpack connection answers in binary frames"
        return msgspec.msgpack.decode(frame)

    async def until(self, kind: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        seen: list[dict[str, Any]] = []
        while (event := await self.recv())["type"] != kind:
            seen.append(event)
        return event, seen


async def test_msgpack_subprotocol_carries_a_whole_turn(fake_gateway: FakeGateway) -> None:
    photo = photo_bytes("chelsea", size=96)
    async with websockets.connect(
        fake_gateway.ws_url, subprotocols=[MSGPACK_SUBPROTOCOL], max_size=None
    ) as ws:
        assert ws.subprotocol == MSGPACK_SUBPROTOCOL
        peer = MsgpackPeer(ws)
        created = await peer.recv()
        assert created["type"] == "session.created"
        await peer.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": data_url(photo)},
                        {"type": "input_text", "text": "a cat"},
                    ],
                },
            }
        )
        encoded, _ = await peer.until("visiongate.image.encoded")
        assert encoded["digest"] == hashlib.sha256(photo).hexdigest()
        await peer.until("conversation.item.done")
        await peer.send({"type": "response.create", "response": {"metadata": {"k": "v"}}})
        done, before = await peer.until("response.done")
        assert collapse([e["type"] for e in before]) == RESPONSE_EVENTS
        assert deltas(before) == "a cat [1 images]"
        assert done["response"]["metadata"] == {"k": "v"}
        assert done["response"]["usage"]["input_token_details"]["image_tokens"] == 4
        # a frame that is not msgpack is an error in msgpack, and the connection stays
        await ws.send(b"\xc1")  # a byte msgpack never uses
        error = await peer.recv()
        assert error["type"] == "error" and error["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
async def test_connecting_while_models_load_gets_busy_and_1013(
    make_gateway: GatewayFactory, binary: bool
) -> None:
    loaded = threading.Event()
    gateway = make_gateway(engine=FakeEngine(loaded=loaded), wait=False)
    try:
        protocols = [MSGPACK_SUBPROTOCOL] if binary else None
        async with websockets.connect(gateway.ws_url, subprotocols=protocols) as ws:
            frame = await ws.recv()
            assert isinstance(frame, bytes) is binary  # in the negotiated codec
            event = msgspec.msgpack.decode(frame) if binary else msgspec.json.decode(frame)
            assert event["type"] == "error" and event["error"]["code"] == "busy"
            assert event["error"]["type"] == "server_error"
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013
    finally:
        loaded.set()
    # once loaded, the same gateway serves
    gateway.server.wait_ready(timeout=TIMEOUT)
    peer = await Peer.open(gateway.ws_url)
    try:
        assert peer.created["type"] == "session.created"
    finally:
        await peer.close()


async def test_engine_busy_fails_the_response_with_busy(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(engine=FakeEngine(busy=True))
    peer = await Peer.open(gateway.ws_url)
    try:
        await peer.add([{"type": "input_text", "text": "hello"}])
        await peer.until("conversation.item.done", timeout=TIMEOUT)
        await peer.send({"type": "response.create", "event_id": "r1"})
        done, before = await peer.until("response.done", timeout=TIMEOUT)
        errors = [e for e in before if e["type"] == "error"]
        assert [e["error"]["code"] for e in errors] == ["busy"]
        assert errors[0]["error"]["event_id"] == "r1"
        response = done["response"]
        assert response["status"] == "failed" and not response.get("output")
        assert response["status_details"]["error"]["code"] == "busy"
    finally:
        await peer.close()


async def test_image_encode_failure_drops_the_item(make_gateway: GatewayFactory) -> None:
    # the header passes the gateway's check; the encoder refuses the image (too many pixels)
    gateway = make_gateway(encoder=FakeEncoder(max_pixels=64 * 64))
    peer = await Peer.open(gateway.ws_url)
    try:
        photo = photo_bytes("astronaut", size=128)
        await peer.add([{"type": "input_image", "image_url": data_url(photo)}], event_id="big")
        added, _ = await peer.until("conversation.item.added", timeout=TIMEOUT)
        error, _ = await peer.until("error", timeout=TIMEOUT)
        assert error["error"]["code"] == "image_too_large"
        assert error["error"]["event_id"] == "big"
        assert added["item"]["id"] in error["error"]["message"]
        assert (await session_view(gateway, peer.session_id))["items"] == []
    finally:
        await peer.close()


async def test_a_fault_while_ending_a_response_still_reaches_the_client(
    fake_gateway: FakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in building response.done must not leave the client waiting for an end that never
    comes: the fallback answer fails too, and the client still gets an internal_error event;
    the connection then serves the next response."""
    from gateway.api.realtime.output import RealtimeResponseWriter

    real_done = RealtimeResponseWriter.done
    calls = 0

    async def broken_done(self: RealtimeResponseWriter, ev: Any) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("building response.done failed")

    monkeypatch.setattr(RealtimeResponseWriter, "done", broken_done)
    peer = await Peer.open(fake_gateway.ws_url)
    try:
        await peer.add([{"type": "input_text", "text": "hello"}])
        await peer.send({"type": "response.create", "event_id": "r1"})
        error, _ = await peer.until("error", timeout=TIMEOUT)
        assert error["error"]["code"] == "internal_error"
        assert error["error"]["event_id"] == "r1"
        await eventually(lambda: calls == 2)  # the real end, then the failed one in its place

        monkeypatch.setattr(RealtimeResponseWriter, "done", real_done)
        await peer.send({"type": "response.create", "event_id": "r2"})
        done, _ = await peer.until("response.done", timeout=TIMEOUT)
        assert done["response"]["status"] == "completed"
    finally:
        await peer.close()


# ---------------------------------------------------------------- the real engine and encoder


@pytest.mark.slow
async def test_two_turn_conversation_with_image(ws_url: str) -> None:
    peer = await Peer.open(ws_url)
    assert peer.created["type"] == "session.created"
    await peer.add(
        [
            {"type": "input_image", "image_url": data_url(unique_photo("astronaut"))},
            {"type": "input_text", "text": "What is in this photo?"},
        ]
    )
    added, _ = await peer.until("conversation.item.added")
    assert added["item"]["content"][0]["image_url"].startswith("visiongate:sha256:")
    encoded, _ = await peer.until("visiongate.image.encoded")
    assert 0 < encoded["tokens_kept"] <= encoded["tokens_total"]
    await peer.until("conversation.item.done")

    done1, before1 = await peer.respond()
    r1 = done1["response"]
    text1 = deltas(before1)
    assert r1["status"] in ("completed", "incomplete")
    assert text1 and text1 == r1["output"][0]["content"][0]["text"]
    assert [e["text"] for e in before1 if e["type"] == "response.output_text.done"] == [text1]
    u1 = r1["usage"]
    assert u1["input_token_details"]["image_tokens"] == encoded["tokens_kept"]
    assert u1["input_tokens"] > u1["input_token_details"]["image_tokens"]
    assert (
        u1["output_tokens"] > 0 and u1["total_tokens"] == u1["input_tokens"] + u1["output_tokens"]
    )
    assert r1["visiongate"]["image_tokens_total"] == encoded["tokens_total"]
    assert r1["visiongate"]["cache"]["vision"] == "miss"
    for key in ("queue_ms", "encode_ms", "prefill_ms", "ttft_ms", "total_ms"):
        assert r1["visiongate"]["timings"][key] >= 0
    assert r1["visiongate"]["timings"]["ttft_ms"] <= r1["visiongate"]["timings"]["total_ms"]

    # turn 2 sees turn 1: the prompt holds turn 1's question, image and answer
    await peer.add([{"type": "input_text", "text": "Say it again in fewer words."}])
    await peer.until("conversation.item.done")
    done2, before2 = await peer.respond()
    r2 = done2["response"]
    assert deltas(before2) == r2["output"][0]["content"][0]["text"]
    assert r2["usage"]["input_tokens"] > u1["input_tokens"] + u1["output_tokens"]
    assert r2["usage"]["input_token_details"]["image_tokens"] == encoded["tokens_kept"]
    assert r2["visiongate"]["cache"]["vision"] == "hit"
    assert r2["visiongate"]["timings"]["encode_ms"] == 0.0
    await peer.close()


@pytest.mark.slow
async def test_cancel_mid_stream(ws_url: str) -> None:
    peer = await Peer.open(ws_url)
    await peer.add([{"type": "input_text", "text": "Count from one to one hundred in words."}])
    await peer.send({"type": "response.create", "response": {"max_output_tokens": 200}})
    first, _ = await peer.until("response.output_text.delta")
    await peer.send({"type": "response.cancel", "event_id": "cancel-1"})
    done, before = await peer.until("response.done")
    r = done["response"]
    assert r["status"] == "cancelled"
    assert r["status_details"]["reason"] == "client_cancelled"
    assert r["usage"]["output_tokens"] < 200
    assert first["delta"] + deltas(before) == r["output"][0]["content"][0]["text"]
    # the connection and the engine both carry on
    done, _ = await peer.respond(max_output_tokens=4)
    assert done["response"]["status"] in ("completed", "incomplete")
    await peer.close()


def _png_bytes(size: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.slow
async def test_bad_frames_get_error_codes_and_connection_survives(ws_url: str) -> None:
    peer = await Peer.open(ws_url)
    big = base64.b64encode(
        b"\xff\xd8\xff" + bytes(3 * 1024 * 1024)
    ).decode()  # over the 2 MiB limit
    cases = [
        ("{not json", "invalid_json", None),
        ('{"type": "conversation.delete_everything", "event_id": "e1"}', "unknown_event", "e1"),
        (
            '{"type": "response.create", "event_id": "e2", '
            '"response": {"max_output_tokens": "lots"}}',
            "invalid_event",
            "e2",
        ),
        (
            {
                "type": "conversation.item.create",
                "event_id": "e3",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": "data:image/png;base64,@@@notbase64"}
                    ],
                },
            },
            "invalid_image",
            "e3",
        ),
        (
            {
                "type": "conversation.item.create",
                "event_id": "e4",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {
                            "type": "input_image",
                            "image_url": data_url(b"just some text, not pixels"),
                        }
                    ],
                },
            },
            "invalid_image",
            "e4",
        ),
        (
            {
                "type": "conversation.item.create",
                "event_id": "e5",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": f"data:image/jpeg;base64,{big}"}
                    ],
                },
            },
            "image_too_large",
            "e5",
        ),
        (
            {
                "type": "conversation.item.create",
                "event_id": "e6",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {
                            "type": "input_image",
                            "image_url": data_url(_png_bytes(2100), "image/png"),
                        }
                    ],
                },
            },
            "image_too_large",
            "e6",
        ),  # 4.4 MP over the 4 MP pixel limit
        (
            {
                "type": "conversation.item.create",
                "event_id": "e7",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": "visiongate:sha256:" + "ab" * 32}
                    ],
                },
            },
            "image_not_found",
            "e7",
        ),
        ({"type": "response.cancel", "event_id": "e8"}, "response_not_found", "e8"),
    ]
    for frame, code, event_id in cases:
        await peer.send(frame)
        event = await peer.recv()
        assert event["type"] == "error", (code, event)
        assert event["error"]["code"] == code, event
        assert event["error"]["event_id"] == event_id
        assert event["error"]["message"]
    # nothing bad was added to the conversation, and the next valid request works
    await peer.add([{"type": "input_text", "text": "Hello!"}], event_id="ok")
    added, skipped = await peer.until("conversation.item.added")
    assert not [e for e in skipped if e["type"] == "error"]
    done, _ = await peer.respond(max_output_tokens=4)
    assert done["response"]["status"] in ("completed", "incomplete")
    assert done["response"]["usage"]["input_token_details"]["image_tokens"] == 0
    await peer.close()


@pytest.mark.slow
async def test_second_response_while_one_runs_is_refused(ws_url: str) -> None:
    peer = await Peer.open(ws_url)
    await peer.add([{"type": "input_text", "text": "Tell me a story."}])
    await peer.send({"type": "response.create", "response": {"max_output_tokens": 40}})
    await peer.until("response.created")
    await peer.send({"type": "response.create", "event_id": "again"})
    error, _ = await peer.until("error")
    assert error["error"]["code"] == "response_in_progress"
    assert error["error"]["event_id"] == "again"
    await peer.send({"type": "response.cancel"})
    done, _ = await peer.until("response.done")
    assert done["response"]["status"] in ("cancelled", "completed", "incomplete")
    await peer.close()


@pytest.mark.slow
async def test_disconnect_mid_response_frees_the_engine(ws_url: str) -> None:
    quitter = await Peer.open(ws_url)
    await quitter.add([{"type": "input_text", "text": "Write a very long essay about the sea."}])
    await quitter.send({"type": "response.create", "response": {"max_output_tokens": 400}})
    await quitter.until("response.output_text.delta")
    await quitter.close()  # gone mid-answer: 400 tokens would take the engine ~15 s

    other = await Peer.open(ws_url)
    await other.add([{"type": "input_text", "text": "Hi"}])
    done, _ = await other.respond(max_output_tokens=4)
    r = done["response"]
    assert r["status"] in ("completed", "incomplete")
    # it waited for at most a decode step or two of the abandoned answer, not for all of it
    assert r["visiongate"]["timings"]["queue_ms"] < 3000
    await other.close()


@pytest.mark.slow
async def test_resume_by_session_id(ws_url: str, chelsea_jpeg: bytes) -> None:
    first = await Peer.open(ws_url)
    session_id = first.session_id
    await first.send(
        {"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief."}}
    )
    updated, _ = await first.until("session.updated")
    assert updated["session"]["instructions"] == "Be brief."
    await first.add(
        [
            {"type": "input_image", "image_url": data_url(chelsea_jpeg)},
            {"type": "input_text", "text": "What animal is this?"},
        ]
    )
    await first.until("conversation.item.done")
    done1, _ = await first.respond()
    answer1 = done1["response"]["output"][0]["content"][0]["text"]
    await first.close()

    again = await Peer.open(ws_url, session_id=session_id)
    assert again.created["type"] == "session.created"
    session = again.created["session"]
    assert session["id"] == session_id and session["instructions"] == "Be brief."
    history = session["visiongate"]["items"]
    assert session["visiongate"]["resumed"] is True
    assert [i["role"] for i in history] == ["user", "assistant"]
    assert history[1]["content"][0]["text"] == answer1
    assert history[0]["content"][0]["image_url"].startswith("visiongate:sha256:")
    await again.add([{"type": "input_text", "text": "And its colour?"}])
    done2, _ = await again.respond()
    r2 = done2["response"]
    assert r2["usage"]["input_tokens"] > done1["response"]["usage"]["input_tokens"]
    assert r2["visiongate"]["cache"]["vision"] == "hit"
    await again.close()


@pytest.mark.slow
async def test_unknown_session_id_is_refused(ws_url: str) -> None:
    ws = await websockets.connect(ws_url + "?session_id=sess_doesnotexist")
    event = msgspec.json.decode(await ws.recv())
    assert event["type"] == "error" and event["error"]["code"] == "session_not_found"
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd.code == 1008


@pytest.mark.slow
async def test_msgpack_subprotocol(ws_url: str) -> None:
    async with websockets.connect(ws_url, subprotocols=["visiongate.v1.msgpack"]) as ws:
        assert ws.subprotocol == "visiongate.v1.msgpack"
        created = msgspec.msgpack.decode(await ws.recv())
        assert created["type"] == "session.created"
        await ws.send(
            msgspec.msgpack.encode(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "Hi"}],
                    },
                }
            )
        )
        await ws.send(
            msgspec.msgpack.encode(
                {"type": "response.create", "response": {"max_output_tokens": 3}}
            )
        )
        while True:
            event = msgspec.msgpack.decode(await asyncio.wait_for(ws.recv(), 120))
            if event["type"] == "response.done":
                break
        assert event["response"]["usage"]["output_tokens"] >= 1


@pytest.mark.slow
async def test_sdk_client_two_turns_and_cancel(ws_url: str) -> None:
    from gateway.sdk.client import RealtimeClient, RealtimeError

    image = photo_bytes("coffee")
    async with await RealtimeClient.connect(ws_url) as client:
        item = await client.add_image(image)
        encoded = await client.wait_encoded(item)
        answer = await client.ask("What is this?")
        chunks = [c async for c in answer]
        assert "".join(chunks) == answer.result.text
        assert answer.result.image_tokens == encoded["tokens_kept"]
        follow = await client.ask("Anything else?", max_output_tokens=100)
        async for _ in follow:
            await follow.cancel()
            break
        result = await follow.finish()
        assert result.status == "cancelled"
        with pytest.raises(RealtimeError) as err:
            await client.add_image(b"definitely not an image")
        assert err.value.code == "invalid_image"
        session_id = client.session_id
    async with await RealtimeClient.connect(ws_url, session_id=session_id) as resumed:
        assert [i["role"] for i in resumed.history][:2] == ["user", "user"]
    with pytest.raises(RealtimeError) as err:
        await RealtimeClient.connect(ws_url, session_id="sess_nope")
    assert err.value.code == "session_not_found"


@pytest.mark.slow
async def test_official_openai_realtime_client(gateway_server, astronaut_jpeg: bytes) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{gateway_server.http_url}/v1", api_key="not-needed")
    async with client.realtime.connect(model="SmolLM2-135M-Instruct") as conn:
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(astronaut_jpeg)},
                    {"type": "input_text", "text": "Describe the image."},
                ],
            }
        )
        await conn.response.create(response={"max_output_tokens": 12})
        text, done = [], None
        async for event in conn:
            if event.type == "response.output_text.delta":
                text.append(event.delta)
            elif event.type == "error":
                pytest.fail(f"error event: {event.error}")
            elif event.type == "response.done":
                done = event
                break
    assert done is not None and done.response.status in ("completed", "incomplete")
    assert "".join(text) == done.response.output[0].content[0].text
    assert done.response.usage.input_token_details.image_tokens > 0
    await client.close()
