"""A hostile client against Realtime function calling, item retrieve/delete/truncate,
out-of-band responses, per-response metadata, KV warm-ups, and structured-output schemas.

One real gateway on loopback over the fake engine (its deltas spaced, so a response can be
caught mid-stream) and raw WebSocket frames, so malformed and oversized events reach the
server as a client would send them. Every attack must get a stable error code (or bounded
work), leave the connection serving (a `session.update` round trip after it) and leave the
stored conversation whole.
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.chat.schema_bounds import bound_schema
from gateway.engine.interface import EngineCapabilities, GenerationRequest, WarmUpResult
from gateway.testing.fake_gateway import FakeGateway, eventually, start_gateway, unit_settings
from gateway.testing.fakes import FakeEncoder, FakeEngine
from gateway.testing.realtime_peer import Peer, data_url
from tests.conftest import unique_photo


class WarmCountingEngine(FakeEngine):
    """The fake engine, its deltas spaced; warm-ups are counted and take a moment."""

    capabilities = EngineCapabilities(warm_up=True)

    def __init__(self) -> None:
        super().__init__(delay_s=0.02)
        self.warm_ups: list[GenerationRequest] = []
        self.warming = 0
        self.most_warming = 0  # warm-ups running at the same time, at most

    async def warm_up(self, request: GenerationRequest) -> WarmUpResult:
        self.warm_ups.append(request)
        self.warming += 1
        self.most_warming = max(self.most_warming, self.warming)
        try:
            await asyncio.sleep(0.1)
        finally:
            self.warming -= 1
        return WarmUpResult("warmed")


@pytest.fixture(scope="module")
def gateway() -> Iterator[FakeGateway]:
    started = start_gateway(unit_settings(), WarmCountingEngine(), FakeEncoder())
    yield started
    started.server.stop()


def text_item(text: str, **fields: Any) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
        **fields,
    }


def call_item(call_id: str, **fields: Any) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}", **fields}


def output_item(call_id: str, output: str = "sunny", **fields: Any) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output, **fields}


async def answer(peer: Peer, event: dict[str, Any] | str) -> dict[str, Any]:
    """The server's first reply to `event` that is an error or the event's done/ack."""
    await peer.send(event)
    reply, _ = await peer.until(
        "error",
        "conversation.item.done",
        "conversation.item.deleted",
        "conversation.item.truncated",
        "conversation.item.retrieved",
        "session.updated",
        "response.created",
        timeout=10,
    )
    return reply


async def refused(peer: Peer, event: dict[str, Any] | str, code: str) -> dict[str, Any]:
    reply = await answer(peer, event)
    assert reply["type"] == "error", reply
    assert reply["error"]["code"] == code, reply["error"]
    await still_serving(peer)
    return reply["error"]


async def still_serving(peer: Peer) -> None:
    reply = await answer(peer, {"type": "session.update", "session": {}})
    assert reply["type"] == "session.updated", reply


async def stored_items(gateway: FakeGateway, session_id: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=10) as client:
        reply = await client.get(f"/v1/sessions/{session_id}")
    assert reply.status_code == 200, reply.text
    return reply.json()["items"]


async def test_tool_schemas_of_any_size_are_refused_with_stable_codes(gateway) -> None:
    peer = await Peer.open(gateway.ws_url)
    try:
        depth = 5000
        deep = '{"type":"object","properties":{"a":' * depth + "{}" + "}}" * depth
        tools = f'[{{"type":"function","name":"f","parameters":{deep}}}]'
        for frame in (
            f'{{"type":"session.update","session":{{"tools":{tools}}}}}',
            f'{{"type":"response.create","response":{{"tools":{tools}}}}}',
        ):
            await refused(peer, frame, "invalid_json")
        many = [{"type": "function", "name": f"f{i}"} for i in range(3000)]
        error = await refused(
            peer, {"type": "session.update", "session": {"tools": many}}, "invalid_request"
        )
        assert "3000" in error["message"]
        named = {"type": "function", "name": "x" * 100_000}
        await refused(
            peer, {"type": "session.update", "session": {"tools": [named]}}, "invalid_request"
        )
        await refused(
            peer,
            {"type": "session.update", "session": {"tools": [1, None]}},
            "invalid_request",
        )
        # nothing of the refused updates was kept: a plain response still answers in text
        await peer.send({"type": "conversation.item.create", "item": text_item("hello")})
        done, events = await peer.respond()
        assert done["response"]["status"] == "completed", done
        assert not [e for e in events if e["type"] == "error"]
    finally:
        await peer.close()


async def test_function_call_outputs_stay_paired_with_their_calls(gateway) -> None:
    peer = await Peer.open(gateway.ws_url)
    try:
        create = "conversation.item.create"
        await refused(peer, {"type": create, "item": output_item("nope")}, "invalid_request")
        huge = output_item("nope", "x" * 2_000_000)
        await refused(peer, {"type": create, "item": huge}, "invalid_request")
        assert (await answer(peer, {"type": create, "item": call_item("c1", id="call")}))[
            "type"
        ] == "conversation.item.done"
        # a second call with the same id would make its output answer two calls
        error = await refused(peer, {"type": create, "item": call_item("c1")}, "invalid_request")
        assert error["param"] == "item.call_id"
        # placed before its call, the output answers nothing
        first = {"type": create, "item": output_item("c1"), "previous_item_id": "root"}
        await refused(peer, first, "invalid_request")
        too_long = output_item("c1", "y" * (gateway.settings.max_text_chars + 1))
        await refused(peer, {"type": create, "item": too_long}, "input_too_large")
        reply = await answer(peer, {"type": create, "item": output_item("c1", id="out")})
        assert reply["type"] == "conversation.item.done", reply
        # the call cannot go while its output is there; the output first, then the call
        delete = "conversation.item.delete"
        error = await refused(peer, {"type": delete, "item_id": "call"}, "invalid_request")
        assert "'out'" in error["message"]
        for item_id in ("out", "call"):
            reply = await answer(peer, {"type": delete, "item_id": item_id})
            assert reply["type"] == "conversation.item.deleted", reply
        assert await stored_items(gateway, peer.session_id) == []
        # an out-of-band context is checked the same way
        twice, early = [call_item("c2"), call_item("c2")], [output_item("c3"), call_item("c3")]
        for items, at in ((twice, 1), (early, 0)):
            event = {
                "type": "response.create",
                "response": {"conversation": "none", "input": items},
            }
            error = await refused(peer, event, "invalid_request")
            assert error["param"] == f"response.input[{at}].call_id", error
    finally:
        await peer.close()


async def test_items_a_response_reads_or_writes_stay_until_it_ends(gateway) -> None:
    peer = await Peer.open(gateway.ws_url)
    try:
        words = " ".join(f"w{i}" for i in range(20))  # 20 deltas, 20 ms apart
        await answer(peer, {"type": "conversation.item.create", "item": text_item(words, id="q")})
        await peer.send({"type": "response.create"})
        added, _ = await peer.until("response.output_item.added", timeout=10)
        answer_id = added["item"]["id"]
        for item_id in ("q", answer_id):
            await refused(
                peer, {"type": "conversation.item.delete", "item_id": item_id}, "invalid_request"
            )
            truncate = {
                "type": "conversation.item.truncate",
                "item_id": item_id,
                "content_index": 0,
                "audio_end_ms": 0,
            }
            await refused(peer, truncate, "invalid_request")
        # another response (out-of-band or not) waits for this one
        out_of_band = {"conversation": "none", "input": [text_item("x")]}
        await refused(
            peer, {"type": "response.create", "response": out_of_band}, "response_in_progress"
        )
        done, _ = await peer.until("response.done", timeout=10)
        assert done["response"]["status"] == "completed", done
        items = await stored_items(gateway, peer.session_id)
        assert [i["id"] for i in items] == ["q", answer_id]
        assert all(i.get("status", "completed") == "completed" for i in items), items
        for index in (-1, 1, 2**40, 2**64):
            truncate = {
                "type": "conversation.item.truncate",
                "item_id": answer_id,
                "content_index": index,
                "audio_end_ms": 0,
            }
            error = await refused(peer, truncate, "invalid_request")
            assert error["param"] == "content_index"
        for end_ms in (-5, 10):
            truncate = {
                "type": "conversation.item.truncate",
                "item_id": answer_id,
                "content_index": 0,
                "audio_end_ms": end_ms,
            }
            await refused(peer, truncate, "invalid_request")
        # over now: the question can go
        reply = await answer(peer, {"type": "conversation.item.delete", "item_id": "q"})
        assert reply["type"] == "conversation.item.deleted", reply
    finally:
        await peer.close()


async def test_another_sessions_items_are_not_found(gateway) -> None:
    owner, other = await Peer.open(gateway.ws_url), await Peer.open(gateway.ws_url)
    try:
        reply = await answer(
            owner, {"type": "conversation.item.create", "item": text_item("secret", id="mine")}
        )
        assert reply["type"] == "conversation.item.done"
        for kind in ("retrieve", "delete"):
            event = {"type": f"conversation.item.{kind}", "item_id": "mine"}
            await refused(other, event, "item_not_found")
        reference = {"conversation": "none", "input": [{"type": "item_reference", "id": "mine"}]}
        await refused(other, {"type": "response.create", "response": reference}, "item_not_found")
        await refused(
            other, {"type": "conversation.item.retrieve", "item_id": "m" * 10_000}, "invalid_event"
        )
        assert [i["id"] for i in await stored_items(gateway, owner.session_id)] == ["mine"]
    finally:
        await owner.close()
        await other.close()


async def test_out_of_band_input_and_metadata_are_bounded(gateway) -> None:
    peer = await Peer.open(gateway.ws_url)
    settings = gateway.settings
    try:

        def out_of_band(content: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
            message = {"type": "message", "role": "user", "content": content}
            return {
                "type": "response.create",
                "response": {"conversation": "none", "input": [message], **params},
            }

        photos = [
            {"type": "input_image", "image_url": data_url(unique_photo())}
            for _ in range(settings.max_images_per_session + 1)
        ]
        await refused(peer, out_of_band(photos), "too_many_images")
        over_connection = photos[: settings.max_pending_encodes_per_connection + 1]
        await refused(peer, out_of_band(over_connection), "rate_limited")
        many = [text_item("a")] * (settings.max_items_per_session + 1)
        await refused(
            peer,
            {"type": "response.create", "response": {"conversation": "none", "input": many}},
            "input_too_large",
        )
        huge = "x" * (settings.max_text_chars + 1)
        await refused(peer, out_of_band([], instructions=huge), "input_too_large")
        for metadata in (
            {str(i): "v" for i in range(17)},
            {"k" * 65: "v"},
            {"k": "v" * 513},
            {"k": 1},
        ):
            await refused(peer, out_of_band(photos[:1], metadata=metadata), "invalid_event")
        # the refusals held no encode slots: as many images as a connection may encode, answered
        fits = photos[: settings.max_pending_encodes_per_connection]
        metadata = {str(i): "v" * 512 for i in range(16)}
        done, events = await peer.respond(
            conversation="none",
            input=[{"type": "message", "role": "user", "content": fits}],
            metadata=metadata,
        )
        assert done["response"]["status"] == "completed", done
        assert done["response"]["metadata"] == metadata
        assert not [e for e in events if e["type"] == "error"]
        assert await stored_items(gateway, peer.session_id) == []  # out-of-band: never stored
    finally:
        await peer.close()


async def test_create_cancel_loop_leaves_no_response_half_stored(gateway) -> None:
    peer = await Peer.open(gateway.ws_url)
    try:
        await answer(peer, {"type": "conversation.item.create", "item": text_item("a b c d e")})
        for _ in range(100):
            await peer.send({"type": "response.create"})
            await peer.send({"type": "response.cancel"})
        await peer.send({"type": "session.update", "session": {}})
        _, seen = await peer.until("session.updated", timeout=10)
        codes = {e["error"]["code"] for e in seen if e["type"] == "error"}
        assert codes <= {"response_in_progress", "response_not_found"}, codes
        while True:  # until the last cancelled response is done
            try:
                seen.append(await peer.recv(0.5))
            except TimeoutError:
                break
        cancelled = [e for e in seen if e["type"] == "response.done"]
        assert cancelled and all(e["response"]["status"] == "cancelled" for e in cancelled)
        await peer.send({"type": "response.create"})
        created, _ = await peer.until("response.created", timeout=10)
        done, _ = await peer.until("response.done", timeout=10)
        assert done["response"]["id"] == created["response"]["id"]
        assert done["response"]["status"] == "completed", done
        items = await stored_items(gateway, peer.session_id)
        assert all(i.get("status") != "in_progress" for i in items), items
        assert items[0]["role"] == "user" and items[-1]["role"] == "assistant"
    finally:
        await peer.close()


async def test_a_burst_of_image_items_warms_the_session_a_bounded_number_of_times(
    gateway,
) -> None:
    engine: WarmCountingEngine = gateway.engine  # type: ignore[assignment]
    peer = await Peer.open(gateway.ws_url)
    before = len(engine.warm_ups)
    try:
        await peer.add([{"type": "input_image", "image_url": data_url(unique_photo())}])
        first, _ = await peer.until("conversation.item.done", timeout=10)
        reference = first["item"]["content"][0]["image_url"]  # the image, by its digest
        ours = lambda: engine.warm_ups[before:]  # noqa: E731
        deadline = time.monotonic() + 10
        while not ours():
            assert time.monotonic() < deadline, "no warm-up for the photo"
            await asyncio.sleep(0.01)
        burst = 100
        for _ in range(burst):
            await peer.add([{"type": "input_image", "image_url": reference}])
        for _ in range(burst):
            await peer.until("conversation.item.done", timeout=10)
        await eventually(lambda: engine.warming == 0)
        await asyncio.sleep(0.2)  # the one after the last that ran, if any
        await eventually(lambda: engine.warming == 0)
        warmed = len(ours())
        # one at a time, and one more after the burst: not one per item
        assert engine.most_warming == 1
        assert 2 <= warmed <= burst // 5, warmed
        await peer.send({"type": "conversation.item.create", "item": text_item("what is it?")})
        done, _ = await peer.respond()
        assert done["response"]["status"] == "completed", done
    finally:
        await peer.close()


async def test_schema_counts_of_any_size_are_cheap(gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=10) as client:

        async def post(schema: dict[str, Any]) -> httpx.Response:
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            body = {
                "model": FakeEngine.model_id,
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": fmt,
            }
            return await client.post("/v1/chat/completions", json=body)

        huge = {"type": "array", "minItems": 10**7, "items": {"type": "string", "minLength": 10**6}}
        assert (await post(huge)).status_code == 200
        for malformed in (
            {"type": "array", "maxItems": "x"},
            {"type": "string", "minLength": "x"},
            {"type": "array", "prefixItems": {"a": 1}},
            {"type": "object", "properties": [1]},
            {"anyOf": 5},
        ):
            reply = await post(malformed)
            assert reply.status_code == 400, (malformed, reply.text)
            assert reply.json()["error"]["code"] == "invalid_request"
        assert (await client.get("/healthz")).status_code == 200


def test_the_budget_estimate_of_a_huge_min_items_takes_no_memory() -> None:
    # ten million items (a billion took gigabytes): counted, never listed
    schema = {"type": "array", "minItems": 10**7, "items": {"type": "string"}}
    tracemalloc.start()
    try:
        bounded = bound_schema(schema, 32)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert bounded["maxItems"] == 10**7  # never narrower than the schema's own minimum
    assert peak < 1024 * 1024, peak
