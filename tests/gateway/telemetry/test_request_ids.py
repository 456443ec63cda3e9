"""Every response names its request: `x-request-id` on each HTTP response (routed or refused,
streamed or not) and on the WebSocket upgrade, read by the official `openai` client; the same
id on the request's log lines and on its response's root span. Fake engine and encoder."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import websockets
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.chat.response_trace import REQUEST_ID_ATTR
from gateway.server.app import create_app
from gateway.server.runner import ServerThread
from gateway.telemetry.request_ids import accept_request_id
from gateway.testing.fake_gateway import (
    CapturedGateway,
    captured_gateway,
    eventually,
    unit_settings,
)
from gateway.testing.fakes import FakeEncoder, FakeEngine

TIMEOUT = 10.0
NEW_ID = re.compile(r"req_[0-9a-f]{32}")
MiB = 1024 * 1024


class Traced(CapturedGateway):
    """A gateway of this module's own, with its log lines and finished spans captured."""

    def response_spans(self) -> list[Any]:
        return self.finished_spans("chat ")


@pytest.fixture(scope="module")
def traced() -> Iterator[Traced]:
    settings = unit_settings(max_image_bytes=1024)  # uploads past ~1 MiB are refused (413)
    with captured_gateway(settings, log_level="info", cls=Traced) as gateway:
        yield gateway  # type: ignore[misc]


def chat_body(text: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": "fake-echo", "messages": [{"role": "user", "content": text}], **extra}


# (method, path, body or None, the status the request gets)
REQUESTS = [
    ("GET", "/healthz", None, 200),
    ("GET", "/readyz", None, 200),
    ("GET", "/metrics", None, 200),
    ("GET", "/", None, 200),
    ("GET", "/static/playground.js", None, 200),
    ("GET", "/schema/openapi.json", None, 200),
    ("GET", "/v1/models", None, 200),
    ("GET", "/v1/models/nope", None, 404),
    ("GET", "/no/such/path", None, 404),
    ("GET", "/v1/no-such-route", None, 404),
    ("PUT", "/v1/models", None, 405),
    ("POST", "/v1/chat/completions", b"{not json", 400),
    ("POST", "/v1/chat/completions", chat_body(), 200),
    ("POST", "/v1/chat/completions", chat_body(model="nope"), 404),
    ("POST", "/v1/images", b"\0" * (2 * MiB), 413),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), REQUESTS)
def test_every_response_carries_a_new_request_id(
    traced: Traced, method: str, path: str, body: Any, status: int
) -> None:
    kwargs: dict[str, Any] = {"json": body} if isinstance(body, dict) else {"content": body}
    with httpx.Client(base_url=traced.http_url, timeout=TIMEOUT) as client:
        first = client.request(method, path, **kwargs)
        second = client.request(method, path, **kwargs)
    assert first.status_code == second.status_code == status, first.text
    ids = [first.headers.get("x-request-id"), second.headers.get("x-request-id")]
    assert all(i is not None and NEW_ID.fullmatch(i) for i in ids), ids
    assert ids[0] != ids[1]
    assert len(first.headers.get_list("x-request-id")) == 1


def test_a_streamed_response_carries_it_before_the_first_event(traced: Traced) -> None:
    with (
        httpx.Client(base_url=traced.http_url, timeout=TIMEOUT) as client,
        client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        assert NEW_ID.fullmatch(response.headers["x-request-id"])
        assert "[DONE]" in response.read().decode()


@pytest.mark.parametrize("sent", ["trace-7", "a.b_c:d-E9", "x" * 128])
def test_a_client_id_that_is_a_short_token_is_echoed(traced: Traced, sent: str) -> None:
    r = httpx.get(f"{traced.http_url}/v1/models", headers={"X-Request-Id": sent}, timeout=TIMEOUT)
    assert r.headers["x-request-id"] == sent


@pytest.mark.parametrize("sent", ["", "two words", "x" * 129, "a/b", "semi;colon", "caf\xe9"])
def test_any_other_client_id_is_replaced(traced: Traced, sent: str) -> None:
    r = httpx.get(
        f"{traced.http_url}/no/such/path",
        headers=[(b"X-Request-Id", sent.encode("latin-1"))],
        timeout=TIMEOUT,
    )
    assert r.status_code == 404
    assert NEW_ID.fullmatch(r.headers["x-request-id"]), r.headers["x-request-id"]


def test_accept_request_id_keeps_only_short_tokens() -> None:
    assert accept_request_id(b"abc:1") == "abc:1"
    assert accept_request_id("abc:1") == "abc:1"
    assert NEW_ID.fullmatch(accept_request_id(None))
    assert NEW_ID.fullmatch(accept_request_id("abc\n1"))
    assert accept_request_id(None) != accept_request_id(None)


def test_the_openai_client_reads_it(traced: Traced) -> None:
    client = openai.OpenAI(base_url=f"{traced.http_url}/v1", api_key="unused", max_retries=0)
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="fake-echo", messages=[{"role": "user", "content": "hi"}]
        )
        assert NEW_ID.fullmatch(raw.headers["x-request-id"])
        completion = raw.parse()
        assert completion._request_id == raw.headers["x-request-id"]
        assert completion.choices[0].message.content
        echoed = client.chat.completions.with_raw_response.create(
            model="fake-echo",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Request-Id": "app-trace-42"},
        )
        assert echoed.headers["x-request-id"] == "app-trace-42"
        with pytest.raises(openai.NotFoundError) as err:
            client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}]
            )
        assert err.value.request_id is not None and NEW_ID.fullmatch(err.value.request_id)
        assert err.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="fake-echo", messages=[], extra_headers={"X-Request-Id": "bad-1"}
            )
        assert err.value.request_id == "bad-1"
    finally:
        client.close()


async def test_the_openai_client_reads_it_on_a_stream(traced: Traced) -> None:
    client = openai.AsyncOpenAI(base_url=f"{traced.http_url}/v1", api_key="unused")
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model="fake-echo", messages=[{"role": "user", "content": "one two"}], stream=True
        )
        assert NEW_ID.fullmatch(raw.headers["x-request-id"])
        stream = raw.parse()  # with_raw_response: parsing is synchronous, even here
        text = [chunk.choices[0].delta.content or "" async for chunk in stream]
        assert "one two" in "".join(text)
    finally:
        await client.close()


async def test_the_id_is_on_the_log_lines_and_the_response_span(traced: Traced) -> None:
    async with httpx.AsyncClient(base_url=traced.http_url, timeout=TIMEOUT) as client:
        r = await client.post(
            "/v1/chat/completions",
            json=chat_body("log me"),
            headers={"X-Request-Id": "http-span-1"},
        )
    assert r.status_code == 200 and r.headers["x-request-id"] == "http-span-1"
    await eventually(lambda: bool(traced.lines(event="response", request_id="http-span-1")))
    [access] = traced.lines(event="response", request_id="http-span-1")
    assert access["response_id"] == r.json()["id"]
    # the access line is the answer's one line: no other line repeats it
    assert not traced.lines(event="http_completion")
    await eventually(
        lambda: any(
            s.attributes.get(REQUEST_ID_ATTR) == "http-span-1" for s in traced.response_spans()
        )
    )
    [span] = [
        s for s in traced.response_spans() if s.attributes.get(REQUEST_ID_ATTR) == "http-span-1"
    ]
    assert span.attributes["gen_ai.response.id"] == access["response_id"] == r.json()["id"]
    # a request that sends no id has one of its own on its span, never another request's
    async with httpx.AsyncClient(base_url=traced.http_url, timeout=TIMEOUT) as client:
        r = await client.post("/v1/chat/completions", json=chat_body("unnamed"))
    made = r.headers["x-request-id"]
    await eventually(
        lambda: any(s.attributes.get(REQUEST_ID_ATTR) == made for s in traced.response_spans())
    )


async def test_a_websocket_connection_has_one_id_for_its_upgrade_logs_and_responses(
    traced: Traced,
) -> None:
    url = traced.server.ws_url
    async with websockets.connect(url, additional_headers={"X-Request-Id": "ws-conn-1"}) as ws:
        assert ws.response.headers["x-request-id"] == "ws-conn-1"
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created"
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "hi"}],
        }
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        await ws.send(json.dumps({"type": "response.create"}))
        while json.loads(await ws.recv())["type"] != "response.done":
            pass
        await ws.send(json.dumps({"type": "no.such.event", "event_id": "e1"}))
        while json.loads(await ws.recv())["type"] != "error":
            pass
    session_id = created["session"]["id"]
    await eventually(lambda: bool(traced.lines(event="client_error", request_id="ws-conn-1")))
    [opened] = traced.lines(event="session_created", session_id=session_id)
    assert opened["request_id"] == "ws-conn-1"
    await eventually(
        lambda: any(
            s.attributes.get(REQUEST_ID_ATTR) == "ws-conn-1" for s in traced.response_spans()
        )
    )
    [span] = [
        s for s in traced.response_spans() if s.attributes.get(REQUEST_ID_ATTR) == "ws-conn-1"
    ]
    response_id = span.attributes["gen_ai.response.id"]
    [access] = traced.lines(event="response", response_id=response_id)
    assert access["request_id"] == "ws-conn-1" and access["api"] == "realtime"
    async with websockets.connect(url) as ws:
        assert NEW_ID.fullmatch(ws.response.headers["x-request-id"])


def test_requests_on_one_connection_never_share_a_trace() -> None:
    """A large body makes the server pause and resume reading the connection from inside that
    request; the requests after it on the same keep-alive connection still start their own
    traces (no span of an earlier request becomes their parent)."""
    from gateway.sdk.client import image_data_url
    from tests.conftest import unique_photo

    settings = unit_settings()
    app = create_app(settings, engine=FakeEngine(), encoder=FakeEncoder())
    spans = InMemorySpanExporter()
    app.state["gateway"].telemetry.tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    image = {"type": "image_url", "image_url": {"url": image_data_url(unique_photo())}}
    ids = []
    with ServerThread(app, settings) as server:
        server.wait_ready(timeout=30)
        with httpx.Client(base_url=server.http_url, timeout=10) as client:
            for content in ([image, {"type": "text", "text": "hi"}], "hi", "and again"):
                body = {"model": "fake-echo", "messages": [{"role": "user", "content": content}]}
                r = client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                ids.append(r.json()["id"])
    traces = [s.context.trace_id for s in spans.get_finished_spans() if s.name == "chat fake-echo"]
    assert len(traces) == len(ids) == 3
    assert len(set(traces)) == 3, traces
