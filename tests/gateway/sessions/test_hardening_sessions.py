"""Bounded work per request and per session, consistent sessions after disconnects and failures,
and clear errors for frames nested too deeply or a session store that is down (real servers
over the fake engine and encoder)."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import pytest
import websockets

from encoder_worker.types import ImageError
from gateway.protocol.subprotocols import MSGPACK_SUBPROTOCOL
from gateway.testing.fake_gateway import eventually
from gateway.testing.fakes import FakeEncoder, FakeEngine
from gateway.testing.images import data_url
from gateway.testing.realtime_peer import recv_event as recv
from gateway.testing.realtime_peer import until_event as until
from tests.conftest import free_port, photo_bytes

MODEL = FakeEngine.model_id


async def add_text(ws, text: str) -> dict:
    await ws.send(
        json.dumps(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": text}],
                },
            }
        )
    )
    while True:
        event = await recv(ws)
        if event["type"] in ("conversation.item.done", "error"):
            return event


async def still_open(ws) -> None:
    await ws.send(json.dumps({"type": "session.update", "session": {"temperature": 0.0}}))
    assert (await until(ws, "session.updated"))["type"] == "session.updated"


def session_items(base: str, session_id: str) -> list[dict]:
    view = httpx.get(f"{base}/v1/sessions/{session_id}", timeout=10).json()
    return view["items"]


# ---------------------------------------------------------------- nesting depth


async def test_deeply_nested_frames_are_invalid_json_and_the_connection_stays(fake_gateway) -> None:
    deep_json = (
        '{"type":"response.create","response":{"input":' + "[" * 50_000 + "]" * 50_000 + "}}"
    )
    async with websockets.connect(fake_gateway.ws_url, max_size=None) as ws:
        await until(ws, "session.created")
        await ws.send(deep_json)
        error = await until(ws, "error")
        assert error["error"]["code"] == "invalid_json"
        await still_open(ws)
    deep_msgpack = (
        b"\x82"
        + msgspec.msgpack.encode("type")
        + msgspec.msgpack.encode("response.create")
        + msgspec.msgpack.encode("response")
        + b"\x81"
        + msgspec.msgpack.encode("input")
        + b"\x91" * 50_000
        + b"\x90"
    )
    async with websockets.connect(
        fake_gateway.ws_url, subprotocols=[MSGPACK_SUBPROTOCOL], max_size=None
    ) as ws:
        await until(ws, "session.created")
        await ws.send(deep_msgpack)
        assert (await until(ws, "error"))["error"]["code"] == "invalid_json"
    body = (
        '{"model":"fake-echo","messages":[{"role":"user","content":"hi"}],"tools":'
        + "[" * 50_000
        + "]" * 50_000
        + "}"
    )
    r = httpx.post(
        f"{fake_gateway.http_url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert httpx.get(f"{fake_gateway.http_url}/healthz").status_code == 200


# ---------------------------------------------------------------- total size


async def test_a_request_over_the_conversation_size_is_refused_before_the_engine(
    make_gateway,
) -> None:
    gw = make_gateway(settings=dict(max_conversation_chars=200_000, max_text_chars=60_000))
    messages = [{"role": "user", "content": "x " * 25_000} for _ in range(5)]  # 250k chars
    r = httpx.post(
        f"{gw.http_url}/v1/chat/completions",
        timeout=30,
        json={"model": MODEL, "messages": messages},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "input_too_large"
    assert gw.engine.requests == []
    # the same over the WebSocket: items are refused once the session would pass the limit,
    # and the refused item is not stored
    async with websockets.connect(gw.ws_url, max_size=None) as ws:
        created = await until(ws, "session.created")
        results = [await add_text(ws, "y" * 50_000) for _ in range(5)]
        assert [e["type"] for e in results[:3]] == ["conversation.item.done"] * 3
        assert results[4]["type"] == "error"
        assert results[4]["error"]["code"] == "input_too_large"
        await still_open(ws)
    stored = session_items(gw.http_url, created["session"]["id"])
    assert sum(len(i["content"][0]["text"]) for i in stored) <= 200_000


async def test_session_events_carry_a_bounded_summary(fake_gateway) -> None:
    async with websockets.connect(fake_gateway.ws_url, max_size=None) as ws:
        session_id = (await until(ws, "session.created"))["session"]["id"]
        for n in range(40):
            assert (await add_text(ws, f"{n} " + "z" * 5000))["type"] == "conversation.item.done"
        await ws.send(json.dumps({"type": "session.update", "session": {"temperature": 0.5}}))
        updated = (await until(ws, "session.updated"))["session"]["visiongate"]
        assert "items" not in updated and updated["item_count"] == 40
    async with websockets.connect(
        f"{fake_gateway.ws_url}?session_id={session_id}", max_size=None
    ) as ws:
        raw = await asyncio.wait_for(ws.recv(), 10)
        created = json.loads(raw)["session"]["visiongate"]
    assert len(raw) < 100_000  # the session holds 200k characters
    assert created["item_count"] == 40 and created["items_omitted"] == 8
    assert [i["content"][0]["text"].split()[0] for i in created["items"]] == [
        str(n) for n in range(8, 40)
    ]
    assert all(len(i["content"][0]["text"]) < 2100 for i in created["items"])
    full = session_items(fake_gateway.http_url, session_id)  # the whole history, unclipped
    assert len(full) == 40 and len(full[0]["content"][0]["text"]) == 5002


# ---------------------------------------------------------------- disconnects and failures


async def test_a_disconnect_mid_answer_keeps_the_partial_answer(make_gateway) -> None:
    gw = make_gateway(engine=FakeEngine(delay_s=0.05))
    async with websockets.connect(gw.ws_url) as ws:
        session_id = (await until(ws, "session.created"))["session"]["id"]
        await add_text(ws, "one two three four five six seven eight nine ten")
        await ws.send(json.dumps({"type": "response.create"}))
        deltas = [(await until(ws, "response.output_text.delta"))["delta"] for _ in range(3)]

    # the connection is gone; the answer so far stays in the session, marked incomplete
    def answer() -> dict | None:
        items = session_items(gw.http_url, session_id)
        return items[-1] if items[-1]["role"] == "assistant" else None

    await eventually(lambda: (a := answer()) is not None and a["status"] != "in_progress")
    item = answer()
    assert item["status"] == "incomplete"
    assert item["content"][0]["text"].startswith("".join(deltas))
    assert await _engine_idle(gw.engine)


async def _engine_idle(engine: FakeEngine) -> bool:
    await eventually(lambda: engine.running == 0)
    return True


class FailingEncoder(FakeEncoder):
    """Takes a while, then finds every image undecodable (a truncated file past its header)."""

    async def encode(self, data: bytes, *, traceparent: str | None = None, owner=None):
        await asyncio.sleep(0.3)
        raise ImageError("invalid_image", "image data is truncated")


async def test_an_image_that_fails_after_the_socket_closed_leaves_no_item(make_gateway) -> None:
    gw = make_gateway(encoder=FailingEncoder())
    image = data_url(photo_bytes("coffee", size=64))

    async with websockets.connect(gw.ws_url) as ws:
        session_id = (await until(ws, "session.created"))["session"]["id"]
        await add_text(ws, "first")
        await ws.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "what is this?"},
                            {"type": "input_image", "image_url": image},
                        ],
                    },
                }
            )
        )
        await until(ws, "conversation.item.added")
    # closed before the encode failed: the item is removed all the same
    await eventually(lambda: len(session_items(gw.http_url, session_id)) == 1)
    async with websockets.connect(f"{gw.ws_url}?session_id={session_id}") as ws:
        await until(ws, "session.created")
        await ws.send(json.dumps({"type": "response.create"}))
        done = await until(ws, "response.done")
    assert done["response"]["status"] == "completed"  # later responses are not poisoned


async def test_a_websocket_opened_while_the_session_store_is_down_gets_busy(make_gateway) -> None:
    gw = make_gateway(settings=dict(redis_url=f"redis://127.0.0.1:{free_port()}/0"), wait=False)

    # the models load; /readyz then names Redis as the one thing missing
    def only_redis_missing() -> bool:
        try:
            answer = httpx.get(f"{gw.http_url}/readyz", timeout=5)
        except httpx.TransportError:
            return False
        return answer.status_code == 503 and answer.json().get("missing") == ["redis"]

    await eventually(only_redis_missing)
    async with websockets.connect(gw.ws_url) as ws:
        error = await recv(ws)
        assert error["type"] == "error" and error["error"]["code"] == "busy"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd.code == 1013
    assert httpx.get(f"{gw.http_url}/healthz").status_code == 200


# ---------------------------------------------------------------- the context limit over HTTP


async def test_http_truncation_is_chosen_by_the_client(make_gateway) -> None:
    gw = make_gateway(engine=FakeEngine(context_tokens=300))
    history = []
    for n in range(6):
        history.append({"role": "user", "content": " ".join(f"u{n}_{i}" for i in range(40))})
        history.append({"role": "assistant", "content": " ".join(f"a{n}_{i}" for i in range(40))})
    history.append({"role": "user", "content": "and now?"})
    url = f"{gw.http_url}/v1/chat/completions"
    refused = httpx.post(url, json={"model": MODEL, "messages": history}, timeout=10)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    ok = httpx.post(
        url, json={"model": MODEL, "messages": history, "truncation": "auto"}, timeout=10
    )
    assert ok.status_code == 200, ok.text
    assert ok.json()["visiongate"]["truncated_items"] > 0
    assert ok.json()["choices"][0]["message"]["content"] == "and now? [0 images]"


async def test_the_sessions_api_pages_the_history(fake_gateway) -> None:
    async with websockets.connect(fake_gateway.ws_url) as ws:
        session_id = (await until(ws, "session.created"))["session"]["id"]
        for n in range(7):
            await add_text(ws, f"message {n}")
    url = f"{fake_gateway.http_url}/v1/sessions/{session_id}"
    seen: list[str] = []
    after = None
    while True:
        page = httpx.get(url, params={"limit": 3, **({"after": after} if after else {})}).json()
        assert page["item_count"] == 7 and len(page["items"]) <= 3
        seen += [i["content"][0]["text"] for i in page["items"]]
        if not page["has_more"]:
            break
        after = page["items"][-1]["id"]
    assert seen == [f"message {n}" for n in range(7)]
    for params, param in (({"after": "item_nope"}, "after"), ({"limit": 0}, "limit")):
        r = httpx.get(url, params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
