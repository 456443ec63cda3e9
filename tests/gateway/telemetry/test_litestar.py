"""Litestar's OTel plugin on a Telemetry: one server span per HTTP request, none for excluded
paths (the realtime WebSocket included), and no per-chunk send/receive spans on a streamed
(SSE) response."""

from __future__ import annotations

from collections.abc import AsyncIterator

from litestar import Litestar, WebSocket, get, websocket
from litestar.response import ServerSentEvent
from litestar.testing import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.telemetry import Telemetry, litestar_plugin


def test_http_spans_and_exclusions(
    telemetry: Telemetry, span_exporter: InMemorySpanExporter
) -> None:
    @get("/v1/models")
    async def models() -> dict[str, list[str]]:
        return {"data": []}

    @get("/v1/stream")
    async def stream() -> ServerSentEvent:
        async def chunks() -> AsyncIterator[str]:
            for i in range(5):
                yield f"chunk {i}"

        return ServerSentEvent(chunks())

    @get("/healthz")
    async def healthz() -> str:
        return "ok"

    @get("/metrics")
    async def metrics() -> str:
        return telemetry.prometheus_text()[0].decode()

    @websocket("/v1/realtime")
    async def realtime(socket: WebSocket) -> None:
        await socket.accept()
        for _ in range(3):
            await socket.send_text(await socket.receive_text())
        await socket.close()

    app = Litestar(
        [models, stream, healthz, metrics, realtime], plugins=[litestar_plugin(telemetry)]
    )
    with TestClient(app) as client:
        assert client.get("/v1/models").status_code == 200
        assert "chunk 4" in client.get("/v1/stream").text
        assert client.get("/healthz").status_code == 200
        assert client.get("/metrics").status_code == 200
        with client.websocket_connect("/v1/realtime") as ws:
            for i in range(3):
                ws.send_text(f"frame {i}")
                assert ws.receive_text() == f"frame {i}"
    names = [s.name for s in span_exporter.get_finished_spans()]
    assert names.count("GET /v1/models") == 1
    assert names.count("GET /v1/stream") == 1
    assert not [n for n in names if "healthz" in n or "metrics" in n or "realtime" in n], names
    assert not [n for n in names if n.endswith((" send", " receive"))], names
