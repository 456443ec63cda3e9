"""What a running gateway writes to its logs and spans holds no API key and no client string of
unbounded size: every line the process writes (structlog, uvicorn, websockets at debug level,
the HTTP clients of the test itself) is captured through the gateway's own logging setup while
keys travel in every accepted and refused form. The fake engine/encoder stand in for the model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
import websockets

from gateway.policy.auth import QUERY_KEY_REFUSED
from gateway.settings import Settings
from gateway.testing.fake_gateway import CapturedGateway as Captured
from gateway.testing.fake_gateway import captured_gateway

KEY = "sk-live-5b8e0f2d9c41a7"
WRONG = "sk-guess-0c7d3e9a6b12f4"
HUGE = "x" * 1_000_000


@pytest.fixture(scope="module")
def captured() -> Iterator[Captured]:
    settings = Settings.load(
        dict(api_keys=[KEY], max_output_tokens=8, max_image_bytes=2 * 1024 * 1024), environ={}
    )
    # everything, down to websockets' debug lines of the handshake (its request line and
    # headers), goes into the captured logs
    with captured_gateway(settings, log_level="debug", ready_timeout=60) as gateway:
        yield gateway


async def test_api_keys_never_reach_logs_or_spans(captured: Captured) -> None:
    server = captured.server
    # accepted: the subprotocol form, a conversation turn, a close
    async with websockets.connect(
        server.ws_url, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]
    ) as ws:
        assert ws.subprotocol == "realtime"
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "hello there"}],
                    },
                }
            )
        )
        await ws.send(json.dumps({"type": "response.create"}))
        async with asyncio.timeout(30):
            while json.loads(await ws.recv())["type"] != "response.done":
                pass
    # accepted with a header
    async with websockets.connect(
        server.ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}
    ) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
    # refused: a key in the query string, with the reason in the close frame
    async with websockets.connect(f"{server.ws_url}?session_id=s1&api_key={KEY}") as ws:
        with pytest.raises(websockets.ConnectionClosedError) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd.code == 1008 and closed.value.rcvd.reason == QUERY_KEY_REFUSED
    # refused: unknown keys in both forms
    for kwargs in (
        dict(subprotocols=["realtime", f"openai-insecure-api-key.{WRONG}"]),
        dict(additional_headers={"Authorization": f"Bearer {WRONG}"}),
    ):
        with pytest.raises(websockets.InvalidStatus):
            await websockets.connect(server.ws_url, **kwargs)
    # HTTP: a bad key, a key in the query, a good one
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        bad = await client.get("/v1/models", headers={"Authorization": f"Bearer {WRONG}"})
        assert bad.status_code == 401
        query = await client.get("/v1/models", params={"api_key": KEY})
        assert query.status_code == 401
        good = await client.get(
            "/v1/models", params={"api_key": KEY}, headers={"Authorization": f"Bearer {KEY}"}
        )
        assert good.status_code == 200
    await asyncio.sleep(0.2)  # the last lines and spans of the server's thread

    text = captured.logs.getvalue()
    # the capture saw the handshakes, headers included, and the refusals
    assert "WebSocket /v1/realtime?session_id=s1&api_key=[redacted]" in text
    assert "openai-insecure-api-key.[redacted]" in text and "Bearer [redacted]" in text
    assert any(line.get("event") == "response" for line in captured.lines())  # the access line
    for secret in (KEY, WRONG):
        assert secret not in text
        assert secret not in captured.span_text()
    assert "api_key=[redacted]" in captured.span_text()


async def test_a_megabyte_client_string_is_clipped_everywhere(captured: Captured) -> None:
    server = captured.server
    auth = {"Authorization": f"Bearer {KEY}"}
    huge_url = f"data:text/{HUGE};base64,AAAA"
    async with httpx.AsyncClient(base_url=server.http_url, timeout=60) as client:
        reply = await client.post(
            "/v1/chat/completions",
            headers=auth,
            json={
                "model": "fake-echo",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": huge_url}}],
                    }
                ],
            },
        )
    assert reply.status_code == 415, reply.text[:500]
    error = reply.json()["error"]
    assert error["code"] == "unsupported_image_format"
    assert len(error["message"]) < 300 and "(1000005 chars)" in error["message"]

    async with websockets.connect(server.ws_url, additional_headers=auth, max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "event_id": "big",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": huge_url}],
                    },
                }
            )
        )
        event = json.loads(await asyncio.wait_for(ws.recv(), 30))
    assert event["type"] == "error" and event["error"]["code"] == "unsupported_image_format"
    assert len(event["error"]["message"]) < 300
    await asyncio.sleep(0.2)

    lines = captured.lines()
    errors = [
        line
        for line in lines
        if line.get("event") == "client_error" and line.get("code") == "unsupported_image_format"
    ]
    assert len(errors) >= 2  # logged by both APIs, with the clipped message
    assert "x" * 1000 not in captured.logs.getvalue()
    assert max(len(json.dumps(line)) for line in lines) < 10_000
    assert "x" * 1000 not in captured.span_text()
