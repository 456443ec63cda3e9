"""`ServerSend` keeps the server's own `send` in a WebSocket's scope (and only there); with it
in place (the app's outermost layer), a Realtime response streams whole, in order."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from websockets.sync.client import connect

from gateway.api.realtime.server_send import SCOPE_KEY, ServerSend, server_send
from gateway.testing.fake_gateway import FakeGateway


def test_the_scope_of_a_websocket_carries_the_server_send() -> None:
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen[scope["type"]] = server_send(scope)

    async def send(message: Any) -> None:
        return None

    async def receive() -> Any:
        return {}

    wrapped = ServerSend(app)
    asyncio.run(wrapped({"type": "websocket"}, receive, send))
    asyncio.run(wrapped({"type": "http"}, receive, send))
    assert seen == {"websocket": send, "http": None}
    assert server_send({"type": "websocket"}) is None and SCOPE_KEY.startswith("visiongate.")


def test_a_response_streams_whole_through_the_server_send(fake_gateway: FakeGateway) -> None:
    words = " ".join(f"w{i}" for i in range(30))
    request = {
        "type": "response.create",
        "response": {
            "conversation": "none",
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": words}],
                }
            ],
        },
    }
    with connect(fake_gateway.ws_url) as ws:
        assert json.loads(ws.recv())["type"] == "session.created"
        ws.send(json.dumps(request))
        events = []
        while not events or events[-1]["type"] != "response.done":
            events.append(json.loads(ws.recv(timeout=10)))
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == words + " [0 images]"
    ids = [int(e["event_id"].removeprefix("event_")) for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)  # in order, none lost
    assert events[-1]["response"]["status"] == "completed"
