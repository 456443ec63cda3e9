"""The Realtime WebSocket endpoint over a real server, the real engine and the real encoder."""

from __future__ import annotations

import asyncio
import base64
import io

import msgspec
import pytest
import websockets

from gateway.testing.realtime_peer import Peer, data_url, deltas
from tests.conftest import photo_bytes, unique_photo

pytestmark = pytest.mark.slow


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


async def test_unknown_session_id_is_refused(ws_url: str) -> None:
    ws = await websockets.connect(ws_url + "?session_id=sess_doesnotexist")
    event = msgspec.json.decode(await ws.recv())
    assert event["type"] == "error" and event["error"]["code"] == "session_not_found"
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd.code == 1008


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
