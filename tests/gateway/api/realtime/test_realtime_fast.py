"""`/v1/realtime` through the real app and a real `websockets` client, over the fake engine and
encoder: the event sequence, images, cancel, resume, the msgpack codec, loading."""

from __future__ import annotations

import hashlib
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
