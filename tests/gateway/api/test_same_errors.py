"""Both transports refuse the same bad values with the same codes, and stay up afterwards.

Each case is sent over a real WebSocket (`websockets`) as the Realtime event it fits, and over
HTTP (`httpx`) as a chat completion; the error code must be the same on both, each `param`
names the field in that transport's terms, and the connection (WebSocket) and the server
(HTTP) go on answering valid requests.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import websockets

from gateway.engine.interface import MAX_STOP_CHARS, MAX_STOPS
from gateway.protocol.errors import ERROR_CODES
from gateway.testing.fake_gateway import FakeGateway, start_gateway, unit_settings
from gateway.testing.fakes import FakeEncoder, FakeEngine
from gateway.testing.images import data_url as any_data_url

LIMIT = 100  # max_output_tokens_limit
TEXT = 64  # max_text_chars
IMAGES = 2  # max_images_per_session
ITEMS = 4  # max_items_per_session
MODEL = FakeEngine.model_id


def png(color: tuple[int, int, int], size: int = 8) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


data_url = functools.partial(any_data_url, mime="image/png")  # every image here is a PNG


UNKNOWN_REF = "visiongate:sha256:" + "ab" * 32
NOT_AN_IMAGE = data_url(b"just some words, not pixels")
REMOTE = "https://images.example.com/cat.jpg"  # no allow-list: never fetched
THREE = [data_url(png((i * 60, 0, 0))) for i in range(3)]


@dataclass
class Case:
    """`ws`: the Realtime event (None: the Realtime API has no such field); `http`: the chat
    completion's fields over a plain user message; `ws_setup`: events that must succeed first."""

    code: str
    ws: dict[str, Any] | None
    ws_param: str | None
    http: dict[str, Any]
    http_param: str | None
    ws_setup: list[dict[str, Any]] = field(default_factory=list)


def response(**params: Any) -> dict[str, Any]:
    return {"type": "response.create", "response": params}


def session(**config: Any) -> dict[str, Any]:
    return {"type": "session.update", "session": config}


def item(*content: dict[str, Any], role: str = "user") -> dict[str, Any]:
    return {
        "type": "conversation.item.create",
        "item": {"type": "message", "role": role, "content": list(content)},
    }


def ws_image(url: str | None) -> dict[str, Any]:
    return {"type": "input_image"} if url is None else {"type": "input_image", "image_url": url}


def http_image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*content: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(content)}]}


HELLO = {"type": "text", "text": "hello"}
WS_HELLO = {"type": "input_text", "text": "hello"}

CASES: dict[str, Case] = {
    "temperature_3": Case(
        "invalid_request",
        response(temperature=3),
        "response.temperature",
        {"temperature": 3},
        "temperature",
    ),
    "session_temperature_3": Case(
        "invalid_request",
        session(temperature=3),
        "session.temperature",
        {"temperature": 3},
        "temperature",
    ),
    "top_p_0": Case("invalid_request", response(top_p=0), "response.top_p", {"top_p": 0}, "top_p"),
    "seed_negative": Case(
        "invalid_request", response(seed=-1), "response.seed", {"seed": -1}, "seed"
    ),
    "seed_2_63": Case(
        "invalid_request", session(seed=2**63), "session.seed", {"seed": 2**63}, "seed"
    ),
    "max_tokens_0": Case(
        "invalid_request",
        response(max_output_tokens=0),
        "response.max_output_tokens",
        {"max_tokens": 0},
        "max_tokens",
    ),
    "max_tokens_over_limit": Case(
        "invalid_request",
        session(max_output_tokens=LIMIT + 1),
        "session.max_output_tokens",
        {"max_completion_tokens": LIMIT + 1},
        "max_completion_tokens",
    ),
    "five_stops": Case(
        "invalid_request", None, None, {"stop": [f"s{i}" for i in range(MAX_STOPS + 1)]}, "stop"
    ),
    "long_stop": Case(
        "invalid_request", None, None, {"stop": ["ok", "s" * (MAX_STOP_CHARS + 44)]}, "stop[1]"
    ),
    "long_instructions": Case(
        "input_too_large",
        session(instructions="i" * (TEXT + 1)),
        "session.instructions",
        {
            "messages": [
                {"role": "system", "content": "i" * (TEXT + 1)},
                {"role": "user", "content": "hi"},
            ]
        },
        "messages[0].content",
    ),
    "long_response_instructions": Case(
        "input_too_large",
        response(instructions="i" * (TEXT + 1)),
        "response.instructions",
        {
            "messages": [
                {"role": "developer", "content": "i" * (TEXT + 1)},
                {"role": "user", "content": "hi"},
            ]
        },
        "messages[0].content",
    ),
    "long_text": Case(
        "input_too_large",
        item({"type": "input_text", "text": "t" * (TEXT + 1)}),
        "item.content[0].text",
        user({"type": "text", "text": "t" * (TEXT + 1)}),
        "messages[0].content[0].text",
    ),
    "not_an_image": Case(
        "invalid_image",
        item(ws_image(NOT_AN_IMAGE), WS_HELLO),
        "item.content[0].image_url",
        user(http_image(NOT_AN_IMAGE), HELLO),
        "messages[0].content[0].image_url.url",
    ),
    "not_an_image_type": Case(
        "unsupported_image_format",
        item(ws_image("data:text/plain;base64,aGk=")),
        "item.content[0].image_url",
        user(http_image("data:text/plain;base64,aGk=")),
        "messages[0].content[0].image_url.url",
    ),
    "unknown_reference": Case(
        "image_not_found",
        item(WS_HELLO, ws_image(UNKNOWN_REF)),
        "item.content[1].image_url",
        user(HELLO, http_image(UNKNOWN_REF)),
        "messages[0].content[1].image_url.url",
    ),
    "too_many_images": Case(
        "too_many_images",
        item(*map(ws_image, THREE)),
        "item.content",
        user(*map(http_image, THREE)),
        "messages",
    ),
    "image_without_url": Case(
        "invalid_request",
        item(ws_image(None)),
        "item.content[0].image_url",
        user({"type": "image_url", "image_url": {"url": ""}}),
        "messages[0].content[0].image_url.url",
    ),
    "disallowed_remote_url": Case(
        "invalid_image",
        item(ws_image(REMOTE)),
        "item.content[0].image_url",
        user(http_image(REMOTE)),
        "messages[0].content[0].image_url.url",
    ),
    "image_in_assistant_message": Case(
        "invalid_request",
        item(ws_image(THREE[0]), role="assistant"),
        "item.content[0].type",
        {
            "messages": [
                {"role": "assistant", "content": [http_image(THREE[0])]},
                {"role": "user", "content": "hi"},
            ]
        },
        "messages[0].content[0].type",
    ),
    "empty_content": Case("invalid_request", item(), "item.content", user(), "messages[0].content"),
    "text_without_text": Case(
        "invalid_request",
        item({"type": "input_text"}),
        "item.content[0].text",
        user({"type": "text", "text": None}),
        "messages[0].content[0].text",
    ),
    "tools": Case(
        "invalid_request",
        # both take function tools; a tool type they do not run is refused by name
        response(tools=[{"type": "retrieval"}]),
        "response.tools[0].type",
        {"tools": [{"type": "retrieval"}]},
        "tools[0].type",
    ),
    "too_many_items": Case(
        "input_too_large",
        item(WS_HELLO),
        None,
        {"messages": [{"role": "user", "content": f"m{i}"} for i in range(ITEMS + 1)]},
        "messages",
        ws_setup=[item(WS_HELLO) for _ in range(ITEMS)],
    ),
}


@pytest.fixture(scope="module")
def gateway() -> Iterator[FakeGateway]:
    settings = unit_settings(
        max_output_tokens_limit=LIMIT,
        max_text_chars=TEXT,
        max_images_per_session=IMAGES,
        max_items_per_session=ITEMS,
    )
    started = start_gateway(settings, FakeEngine(), FakeEncoder())
    yield started
    started.server.stop()


async def ws_error(gateway: FakeGateway, case: Case) -> dict[str, Any]:
    """Send the case's event (after its setup) and return the error event; then show that the
    same connection still answers."""
    async with websockets.connect(gateway.ws_url, max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        for event in case.ws_setup:
            await ws.send(json.dumps(event))
            while (answer := json.loads(await ws.recv()))["type"] != "conversation.item.done":
                assert answer["type"] != "error", answer
        await ws.send(json.dumps({**case.ws, "event_id": "bad"}))
        while (event := json.loads(await ws.recv()))["type"] != "error":
            assert event["type"] not in (
                "conversation.item.added",
                "session.updated",
                "response.created",
            ), event
        assert event["error"]["event_id"] == "bad"
        # the connection stays open and serves the next valid request
        await ws.send(json.dumps(session(temperature=0.5)))
        while (answer := json.loads(await ws.recv()))["type"] != "session.updated":
            assert answer["type"] != "error", answer
        assert answer["session"]["visiongate"]["temperature"] == 0.5
        return event["error"]


async def http_error(gateway: FakeGateway, case: Case) -> httpx.Response:
    body = {"model": MODEL, **user(HELLO), **case.http}
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=30) as client:
        bad = await client.post("/v1/chat/completions", json=body)
        # the server goes on answering
        ok = await client.post("/v1/chat/completions", json={"model": MODEL, **user(HELLO)})
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["message"]["content"].startswith("hello")
    return bad


@pytest.mark.parametrize("name", list(CASES))
async def test_same_error_on_both_transports(name: str, gateway: FakeGateway) -> None:
    case = CASES[name]
    bad = await http_error(gateway, case)
    error = bad.json()["error"]
    assert (error["code"], error["param"]) == (case.code, case.http_param), error
    assert bad.status_code == ERROR_CODES[case.code][1]
    assert error["type"] == ERROR_CODES[case.code][0] and error["message"]
    if case.ws is None:
        return  # the Realtime API has no field for it
    ws = await ws_error(gateway, case)
    assert (ws["code"], ws["param"]) == (case.code, case.ws_param), ws
    assert ws["type"] == error["type"] and ws["message"]


async def test_refused_values_leave_nothing_behind(gateway: FakeGateway) -> None:
    """A refused item adds nothing to the session, and a refused response reaches no engine."""
    before = len(gateway.engine.requests)
    async with websockets.connect(gateway.ws_url, max_size=None) as ws:
        created = json.loads(await ws.recv())
        for case in ("not_an_image", "unknown_reference", "long_text", "temperature_3"):
            await ws.send(json.dumps(CASES[case].ws))
            while (json.loads(await ws.recv()))["type"] != "error":
                pass
        await ws.send(json.dumps(item(WS_HELLO)))
        while (json.loads(await ws.recv()))["type"] != "conversation.item.done":
            pass
        await ws.send(json.dumps(response(max_output_tokens="inf")))
        while (done := json.loads(await ws.recv()))["type"] != "response.done":
            assert done["type"] != "error", done
    assert done["response"]["status"] == "completed"
    assert done["response"]["output"][0]["content"][0]["text"] == "hello [0 images]"
    assert len(gateway.engine.requests) == before + 1
    # the session, resumed on a new connection, holds the valid turn only
    async with websockets.connect(
        f"{gateway.ws_url}?session_id={created['session']['id']}", max_size=None
    ) as ws:
        resumed = json.loads(await ws.recv())
    items = resumed["session"]["visiongate"]["items"]
    assert [[p["text"] for p in i["content"]] for i in items] == [["hello"], ["hello [0 images]"]]
