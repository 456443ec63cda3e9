"""Frames and requests built to hurt: the wrong frame kind, nesting hidden in a field that fails
validation, ids and metadata of any size, instructions past the conversation cap, methods and
paths routing refuses, a configured key pasted where data goes (real servers over the fakes)."""

from __future__ import annotations

import json

import httpx
import msgspec
import websockets

from gateway.protocol.subprotocols import MSGPACK_SUBPROTOCOL
from gateway.telemetry import register_secrets
from gateway.telemetry._logging import scrub_secrets
from gateway.testing.realtime_peer import until_frame as until

BIG = 100_000


async def error_for(ws, frame: str | bytes) -> tuple[dict, int]:
    await ws.send(frame)
    event, size = await until(ws, "error")
    return event["error"], size


async def still_open(ws, binary: bool = False) -> None:
    update = {"type": "session.update", "session": {"temperature": 0.0}}
    await ws.send(msgspec.msgpack.encode(update) if binary else json.dumps(update))
    await until(ws, "session.updated")


async def test_a_text_frame_on_a_msgpack_connection_is_invalid_json(fake_gateway) -> None:
    async with websockets.connect(fake_gateway.ws_url, subprotocols=[MSGPACK_SUBPROTOCOL]) as ws:
        await until(ws, "session.created")
        for frame in ('{"type":"response.create"}', "hello", ""):
            error, _ = await error_for(ws, frame)
            assert error["code"] == "invalid_json" and "binary" in error["message"]
        await still_open(ws, binary=True)


async def test_nesting_and_broken_syntax_are_invalid_json_as_over_http(fake_gateway) -> None:
    frames = [
        # nesting inside a field that fails validation first
        '{"type":"response.create","response":{"metadata":' + "[" * BIG + "]" * BIG + "}}",
        '{"type":"x","a":' + '{"a":' * 50_000 + "1" + "}" * 50_000 + "}",
        "[" * 200_000,  # never closed: not JSON at all
    ]
    async with websockets.connect(fake_gateway.ws_url, max_size=None) as ws:
        await until(ws, "session.created")
        for frame in frames:
            error, _ = await error_for(ws, frame)
            assert error["code"] == "invalid_json", (frame[:40], error)
        await still_open(ws)
    for body in frames[:1] + frames[2:]:
        r = httpx.post(
            f"{fake_gateway.http_url}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    async with websockets.connect(
        fake_gateway.ws_url, subprotocols=[MSGPACK_SUBPROTOCOL], max_size=None
    ) as ws:
        await until(ws, "session.created")
        error, _ = await error_for(ws, b"\x91" * 200_000 + b"\xc0")
        assert error["code"] == "invalid_json"
        await still_open(ws, binary=True)


async def test_client_ids_and_metadata_are_bounded_and_never_echoed_whole(fake_gateway) -> None:
    async with websockets.connect(fake_gateway.ws_url, max_size=None) as ws:
        session_id = (await until(ws, "session.created"))[0]["session"]["id"]
        error, size = await error_for(
            ws, json.dumps({"type": "response.cancel", "event_id": "e" * BIG})
        )
        assert error["code"] == "invalid_event" and error["event_id"] is None and size < 2000
        error, size = await error_for(
            ws,
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "id": "i" * BIG,
                        "content": [{"type": "input_text", "text": "hi"}],
                    },
                }
            ),
        )
        assert error["code"] == "invalid_event" and error["param"] == "item.id" and size < 2000
        error, size = await error_for(
            ws, json.dumps({"type": "response.create", "response": {"metadata": {"k" * BIG: "v"}}})
        )
        assert error["code"] == "invalid_event" and size < 2000
        await still_open(ws)
    view = httpx.get(f"{fake_gateway.http_url}/v1/sessions/{session_id}", timeout=10).json()
    assert view["items"] == []  # nothing stored


async def test_instructions_count_towards_the_conversation_cap_and_are_clipped_in_events(
    make_gateway,
) -> None:
    gw = make_gateway(settings=dict(max_conversation_chars=70_000, max_text_chars=60_000))
    async with websockets.connect(gw.ws_url, max_size=None) as ws:
        session_id = (await until(ws, "session.created"))[0]["session"]["id"]
        await ws.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "x" * 60_000}],
                    },
                }
            )
        )
        await until(ws, "conversation.item.done")
        error, _ = await error_for(
            ws, json.dumps({"type": "session.update", "session": {"instructions": "y" * 30_000}})
        )
        assert error["code"] == "input_too_large" and error["param"] == "session.instructions"
        await ws.send(
            json.dumps({"type": "session.update", "session": {"instructions": "z" * 9000}})
        )
        updated, size = await until(ws, "session.updated")
        assert size < 4000 and updated["session"]["instructions"].endswith("(9000 chars)")
    view = httpx.get(f"{gw.http_url}/v1/sessions/{session_id}", timeout=10).json()
    assert view["instructions"] == "z" * 9000  # stored whole, clipped only in events


def test_routing_refusals_have_the_openai_error_shape(fake_gateway) -> None:
    for method, path, status in (
        ("DELETE", "/v1/models/x", 405),
        ("PUT", "/v1/images/x", 405),
        ("GET", "/v1/nothing-here", 404),
    ):
        r = httpx.request(method, fake_gateway.http_url + path, timeout=10)
        assert r.status_code == status
        body = r.json()["error"]
        assert body["code"] == "invalid_request" and body["type"] == "invalid_request_error"


def test_a_configured_key_is_redacted_wherever_it_appears() -> None:
    key = "sk-configured-0123456789"
    register_secrets([key])
    event = {
        "event": "client_error",
        "message": f"no session '{key}' for this API key",
        "path": f"/v1/sessions/{key}",
        "long": "a" * 498 + key,
    }
    scrubbed = scrub_secrets(None, "info", dict(event))
    assert all(key not in str(v) and key[:12] not in str(v) for v in scrubbed.values())
    assert "[redacted]" in scrubbed["message"] and "[redacted]" in scrubbed["path"]
