"""`ServerSend` keeps the server's own `send` in a WebSocket's scope (and only there); with it
in place (the app's outermost layer), a Realtime response streams whole, in order."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from opentelemetry.metrics import NoOpMeter
from websockets.sync.client import connect

from gateway.api.http.server_send import SCOPE_KEY, ServerSend, server_send
from gateway.api.realtime import protocol as rt
from gateway.api.realtime.connection_state import ConnectionState, ConnState
from gateway.api.realtime.event_sender import EventSender
from gateway.chat.vision_resolver import EncodeQuota
from gateway.telemetry import GatewayMetrics
from gateway.testing.fake_gateway import FakeGateway


def test_the_scope_of_a_websocket_or_http_request_carries_the_server_send() -> None:
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen[scope["type"]] = server_send(scope)

    async def send(message: Any) -> None:
        return None

    async def receive() -> Any:
        return {}

    wrapped = ServerSend(app)
    asyncio.run(wrapped({"type": "websocket"}, receive, send))
    asyncio.run(wrapped({"type": "http"}, receive, send))  # an SSE answer's chunks (sse_stream)
    asyncio.run(wrapped({"type": "lifespan"}, receive, send))
    assert seen == {"websocket": send, "http": send, "lifespan": None}
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


def test_sends_stay_in_order_while_the_socket_drains() -> None:
    """A send that suspends (a full write buffer) holds the ones made meanwhile behind it."""
    sent: list[str] = []
    drained = asyncio.Event()

    async def server(message: dict[str, Any]) -> None:
        if not sent and not drained.is_set():
            await drained.wait()  # the first frame waits for the socket to drain
        sent.append(message["text"])

    async def run() -> None:
        # a connection's sender alone: no app, no socket but the server's send
        conn = ConnectionState("anonymous", EncodeQuota(0, "this connection"))
        conn.transition(ConnState.OPEN)
        sender = EventSender(conn, server, GatewayMetrics(NoOpMeter("test")))
        events = [rt.OutputTextDelta(f"e{i}", "r", "i", 0, 0, str(i)) for i in range(4)]
        tasks = [asyncio.ensure_future(sender.send(e)) for e in events]
        await asyncio.sleep(0.01)
        assert sent == []  # all held behind the first
        drained.set()
        await asyncio.gather(*tasks)

    asyncio.run(run())
    assert [json.loads(t)["delta"] for t in sent] == ["0", "1", "2", "3"]
