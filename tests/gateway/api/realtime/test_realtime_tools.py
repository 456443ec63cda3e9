"""Realtime function calling, item retrieve/delete/truncate, out-of-band responses and
per-response instructions and metadata, through the official `openai` SDK's realtime client
against the real app over loopback. One gateway for the module, its engine answering a
scripted text (a tool call's fixed text, which the fake engine's echo cannot write) or, with no
script left, echoing as the fake engine does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest

from gateway.chat.output_grammar import plain_text_grammar
from gateway.chat.tool_stream import call_id, render_tool_call, render_tool_result
from gateway.engine.interface import (
    Delta,
    EngineCapabilities,
    GenerationRequest,
    GenerationResult,
    ImageInput,
    TextDelta,
    WarmUpResult,
)
from gateway.testing.fake_gateway import (
    FakeGateway,
    GatewayFactory,
    eventually,
    start_gateway,
    unit_settings,
)
from gateway.testing.fakes import FakeEncoder, FakeEngine
from gateway.testing.realtime_peer import Peer, data_url
from tests.conftest import unique_photo

TIMEOUT = 10.0
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
PARIS = render_tool_call("get_weather", '{"city": "Paris"}')


class ScriptedEngine(FakeEngine):
    """Answers the next text of `script` (five characters a delta, so a call's fixed text is
    split as a model's is); with none left, echoes as the fake engine does."""

    capabilities = EngineCapabilities(warm_up=True)

    def __init__(self) -> None:
        super().__init__()
        self.script: list[str] = []
        self.warm_ups: list[GenerationRequest] = []

    async def warm_up(self, request: GenerationRequest) -> WarmUpResult:
        self.warm_ups.append(request)
        return WarmUpResult("warmed")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        if not self.script:
            async for delta in super().generate(request):
                yield delta
            return
        self.requests.append(request)
        text = self.script.pop(0)
        input_tokens, image_tokens = self._prompt_tokens(request)
        pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
        for piece in pieces:
            yield TextDelta(piece)
        yield GenerationResult(text, "stop", input_tokens, image_tokens, len(pieces))


@pytest.fixture(scope="module")
def gateway() -> Iterator[FakeGateway]:
    started = start_gateway(unit_settings(), ScriptedEngine(), FakeEncoder())
    yield started
    started.server.stop()


@asynccontextmanager
async def realtime(gateway: FakeGateway) -> AsyncIterator[Any]:
    client = openai.AsyncOpenAI(base_url=f"{gateway.http_url}/v1", api_key="unused")
    try:
        async with client.realtime.connect(model="fake-echo") as conn:
            created = await recv(conn)
            assert created.type == "session.created"
            conn.session_id = created.session.id
            yield conn
    finally:
        await client.close()


async def recv(conn: Any) -> Any:
    return await asyncio.wait_for(conn.recv(), TIMEOUT)


async def until(conn: Any, *types: str) -> tuple[Any, list[Any]]:
    """Events up to one of `types`: that one, and those before it."""
    seen = []
    while True:
        event = await recv(conn)
        if event.type in types:
            return event, seen
        seen.append(event)


async def add(conn: Any, item: dict[str, Any], **fields: Any) -> Any:
    await conn.conversation.item.create(item=item, **fields)
    event, _ = await until(conn, "conversation.item.done", "error")
    assert event.type == "conversation.item.done", event
    return event.item


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": list(parts)}


def text(value: str) -> dict[str, Any]:
    return {"type": "input_text", "text": value}


def last_request(gateway: FakeGateway) -> GenerationRequest:
    return gateway.engine.requests[-1]


def shown(request: GenerationRequest) -> list[tuple[str, list[str]]]:
    """The messages the engine was given, images by their id."""
    return [
        (m.role, [p if isinstance(p, str) else f"<image {p.digest}>" for p in m.content])
        for m in request.messages
    ]


async def stored_items(gateway: FakeGateway, session_id: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=TIMEOUT) as client:
        r = await client.get(f"/v1/sessions/{session_id}")
    assert r.status_code == 200, r.text
    return r.json()["items"]


async def error_of(conn: Any, event_id: str) -> Any:
    event, _ = await until(conn, "error")
    assert event.error.event_id == event_id
    return event.error


# ---------------------------------------------------------------- function calling


async def test_tool_round_trip_renders_as_chat_completions(gateway: FakeGateway) -> None:
    engine: ScriptedEngine = gateway.engine  # type: ignore[assignment]
    photo = data_url(unique_photo("astronaut"))
    async with realtime(gateway) as conn:
        await conn.session.update(
            session={"type": "realtime", "tools": [WEATHER], "tool_choice": "required"}
        )
        updated, _ = await until(conn, "session.updated")
        assert updated.session.tools[0].name == "get_weather"
        assert updated.session.tool_choice == "required"
        asked = await add(
            conn, user({"type": "input_image", "image_url": photo}, text("Weather there?"))
        )

        engine.script = [PARIS]
        await conn.response.create(response={"max_output_tokens": 20})
        done, events = await until(conn, "response.done")
        realtime_call = last_request(gateway)
        types = [e.type for e in events]
        assert types[:2] == ["response.created", "response.output_item.added"]
        assert types[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]
        assert set(types[2:-2]) == {"response.function_call_arguments.delta"}
        added = events[1].item
        assert (added.type, added.name, added.status) == (
            "function_call",
            "get_weather",
            "in_progress",
        )
        streamed = "".join(e.delta for e in events if e.type.endswith("arguments.delta"))
        args_done = events[-2]
        assert streamed == args_done.arguments == '{"city": "Paris"}'
        assert args_done.call_id == added.call_id == call_id(done.response.id, 0)
        assert args_done.name == "get_weather" and args_done.item_id == added.id
        [call] = done.response.output
        assert (call.type, call.id, call.status) == ("function_call", added.id, "completed")
        assert call.arguments == '{"city": "Paris"}'
        request = last_request(gateway)
        assert request.sampling.grammar and "<tools>" in request.messages[0].content[0]

        output = await add(
            conn,
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21C"},
        )
        assert (output.type, output.call_id, output.output) == (
            "function_call_output",
            call.call_id,
            "Sunny, 21C",
        )
        await conn.response.create(response={"tool_choice": "none"})
        answer, _ = await until(conn, "response.done")
        assert answer.response.output[0].type == "message"
        realtime_prompt = shown(last_request(gateway))
        items = await stored_items(gateway, conn.session_id)
    assert [i["id"] for i in items[:3]] == [asked.id, call.id, output.id]

    # the same turns over Chat Completions reach the engine as the same messages, under the
    # same grammar (the answer's token budget bounds the arguments on both)
    client = openai.AsyncOpenAI(base_url=f"{gateway.http_url}/v1", api_key="unused")
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    question = {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": photo}},
            {"type": "text", "text": "Weather there?"},
        ],
    }
    try:
        engine.script = [PARIS]
        await client.chat.completions.create(
            model="fake-echo",
            tools=[chat_tool],
            tool_choice="required",
            max_tokens=20,
            messages=[question],
        )
        chat_call = last_request(gateway)
        assert shown(chat_call) == shown(realtime_call)
        assert chat_call.sampling.grammar == realtime_call.sampling.grammar
        await client.chat.completions.create(
            model="fake-echo",
            tools=[chat_tool],
            tool_choice="required",
            max_tokens=30,
            messages=[question],
        )
        assert last_request(gateway).sampling.grammar != realtime_call.sampling.grammar
        await client.chat.completions.create(
            model="fake-echo",
            tools=[chat_tool],
            tool_choice="none",
            messages=[
                question,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call.call_id,
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": call.arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21C"},
            ],
        )
    finally:
        await client.close()
    chat_prompt = shown(last_request(gateway))
    assert realtime_prompt == chat_prompt
    assert realtime_prompt[2:] == [
        ("assistant", [PARIS]),
        ("user", [render_tool_result("Sunny, 21C")]),
    ]


async def test_parallel_calls_are_items_of_their_own_and_join_again_for_the_model(
    gateway: FakeGateway,
) -> None:
    engine: ScriptedEngine = gateway.engine  # type: ignore[assignment]
    both = PARIS + "\n" + render_tool_call("get_time", "{}")
    async with realtime(gateway) as conn:
        await add(conn, user(text("Weather and time?")))
        engine.script = [both]
        await conn.response.create(response={"tools": [WEATHER, TIME]})
        done, events = await until(conn, "response.done")
        calls = done.response.output
        assert [c.name for c in calls] == ["get_weather", "get_time"]
        assert calls[1].id == f"{calls[0].id}_1"
        assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
        # each call is an item of the conversation
        for call in calls:
            await conn.conversation.item.retrieve(item_id=call.id)
            got, _ = await until(conn, "conversation.item.retrieved")
            assert (got.item.id, got.item.call_id, got.item.arguments) == (
                call.id,
                call.call_id,
                call.arguments,
            )
        for call, result in zip(calls, ["rain", "noon"], strict=True):
            await add(
                conn, {"type": "function_call_output", "call_id": call.call_id, "output": result}
            )
        await conn.response.create()  # the session has no tools: a plain answer
        await until(conn, "response.done")
    # as over Chat Completions: with no tools offered, results are answered in words
    assert last_request(gateway).sampling.grammar == plain_text_grammar()
    assert shown(last_request(gateway))[-3:] == [
        ("assistant", [both]),
        ("user", [render_tool_result("rain")]),
        ("user", [render_tool_result("noon")]),
    ]


async def test_a_client_replays_a_call_and_the_model_reads_it(gateway: FakeGateway) -> None:
    async with realtime(gateway) as conn:
        await add(conn, user(text("Weather in Oslo?")))
        call = await add(
            conn,
            {
                "type": "function_call",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
                "call_id": "call_oslo",
            },
        )
        assert (call.type, call.call_id, call.name) == ("function_call", "call_oslo", "get_weather")
        await add(conn, {"type": "function_call_output", "call_id": "call_oslo", "output": "snow"})
        await add(conn, user(text("and so?")))
        await conn.response.create(response={"tools": [WEATHER], "tool_choice": "none"})
        done, _ = await until(conn, "response.done")
        assert done.response.output[0].content[0].text.startswith("and so?")
    assert shown(last_request(gateway))[1:] == [
        ("user", ["Weather in Oslo?"]),
        ("assistant", [render_tool_call("get_weather", '{"city": "Oslo"}')]),
        ("user", [render_tool_result("snow")]),
        ("user", ["and so?"]),
    ]


@pytest.mark.parametrize(
    ("session", "param"),
    [
        ({"tools": [{**WEATHER, "type": "mcp"}]}, "session.tools[0].type"),
        ({"tools": [{**WEATHER, "name": "no spaces"}]}, "session.tools[0].name"),
        ({"tools": [WEATHER, WEATHER]}, "session.tools[1].name"),
        (
            {"tools": [{**WEATHER, "parameters": {"type": "array"}}]},
            "session.tools[0].parameters.type",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            "session.tool_choice.name",
        ),
        ({"tools": [], "tool_choice": "required"}, "session.tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "session.tool_choice"),
    ],
)
async def test_session_tools_are_checked_and_a_refusal_changes_nothing(
    gateway: FakeGateway, session: dict[str, Any], param: str
) -> None:
    async with realtime(gateway) as conn:
        await conn.session.update(session={"type": "realtime", "tools": [TIME]})
        await until(conn, "session.updated")
        await conn.session.update(session={"type": "realtime", **session}, event_id="bad")
        error = await error_of(conn, "bad")
        assert (error.code, error.param) == ("invalid_request", param)
        await conn.session.update(session={"type": "realtime", "instructions": "Be brief."})
        updated, _ = await until(conn, "session.updated")
        assert [t.name for t in updated.session.tools] == ["get_time"]
        assert updated.session.tool_choice is None


@pytest.mark.parametrize(
    ("response", "param"),
    [
        ({"tool_choice": "required"}, "response.tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "response.tools[0].type"),
        ({"conversation": "conv_other"}, "response.conversation"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}},
            "response.tool_choice.name",
        ),
    ],
)
async def test_response_tools_are_checked(
    gateway: FakeGateway, response: dict[str, Any], param: str
) -> None:
    async with realtime(gateway) as conn:
        await add(conn, user(text("hello")))
        await conn.response.create(response=response, event_id="bad")
        error = await error_of(conn, "bad")
        assert (error.code, error.param) == ("invalid_request", param)
        await conn.response.create()  # nothing was started: the next one runs
        done, _ = await until(conn, "response.done")
        assert done.response.status == "completed"


async def test_response_tool_choice_picks_among_the_session_tools(gateway: FakeGateway) -> None:
    engine: ScriptedEngine = gateway.engine  # type: ignore[assignment]
    async with realtime(gateway) as conn:
        await conn.session.update(session={"type": "realtime", "tools": [WEATHER, TIME]})
        await until(conn, "session.updated")
        await add(conn, user(text("What time is it?")))
        engine.script = [render_tool_call("get_time", "{}")]
        await conn.response.create(
            response={"tool_choice": {"type": "function", "name": "get_time"}}
        )
        done, _ = await until(conn, "response.done")
        assert [c.name for c in done.response.output] == ["get_time"]
    grammar = last_request(gateway).sampling.grammar
    assert '"get_time' in grammar and '"get_weather' not in grammar


async def test_a_tool_result_must_answer_a_call(gateway: FakeGateway) -> None:
    async with realtime(gateway) as conn:
        await conn.conversation.item.create(
            item={"type": "function_call_output", "call_id": "call_nobody", "output": "x"},
            event_id="orphan",
        )
        error = await error_of(conn, "orphan")
        assert (error.code, error.param) == ("invalid_request", "item.call_id")
        assert await stored_items(gateway, conn.session_id) == []


# ---------------------------------------------------------------- items


async def test_retrieve_delete_and_truncate_items(gateway: FakeGateway) -> None:
    async with realtime(gateway) as conn:
        first = await add(
            conn,
            user(text("one two")),
        )
        second = await add(conn, user(text("three four")))
        await conn.conversation.item.retrieve(item_id=first.id)
        got, _ = await until(conn, "conversation.item.retrieved")
        assert got.item.id == first.id and got.item.content[0].text == "one two"

        await conn.conversation.item.delete(item_id=first.id, event_id="d1")
        deleted, _ = await until(conn, "conversation.item.deleted")
        assert deleted.item_id == first.id
        assert [i["id"] for i in await stored_items(gateway, conn.session_id)] == [second.id]
        for send in (
            conn.conversation.item.retrieve(item_id=first.id, event_id="gone1"),
            conn.conversation.item.delete(item_id=first.id, event_id="gone2"),
            conn.conversation.item.truncate(
                item_id="item_nope", content_index=0, audio_end_ms=0, event_id="gone3"
            ),
        ):
            await send
        for event_id in ("gone1", "gone2", "gone3"):
            error = await error_of(conn, event_id)
            assert (error.code, error.param) == ("item_not_found", "item_id")

        await conn.response.create()
        done, _ = await until(conn, "response.done")
        answer = done.response.output[0]
        assert answer.content[0].text == "three four [0 images]"
        bad = [
            (second.id, 0, 0, "item_id"),  # a user message
            (answer.id, 1, 0, "content_index"),
            (answer.id, 0, 1500, "audio_end_ms"),  # text items hold no audio
        ]
        for n, (item_id, index, end_ms, param) in enumerate(bad):
            await conn.conversation.item.truncate(
                item_id=item_id, content_index=index, audio_end_ms=end_ms, event_id=f"t{n}"
            )
            error = await error_of(conn, f"t{n}")
            assert (error.code, error.param) == ("invalid_request", param)
        await conn.conversation.item.truncate(item_id=answer.id, content_index=0, audio_end_ms=0)
        truncated, _ = await until(conn, "conversation.item.truncated")
        assert (truncated.item_id, truncated.content_index, truncated.audio_end_ms) == (
            answer.id,
            0,
            0,
        )
        await add(conn, user(text("five")))
        await conn.response.create()
        await until(conn, "response.done")
    assert shown(last_request(gateway)) == [
        ("user", ["three four"]),
        ("assistant", [""]),
        ("user", ["five"]),
    ]


# ---------------------------------------------------------------- out of band, per response


async def test_out_of_band_response_reads_its_own_input_and_stores_nothing(
    gateway: FakeGateway,
) -> None:
    photo = unique_photo("chelsea")
    async with realtime(gateway) as conn:
        kept = await add(conn, user(text("stored question")))
        before = await stored_items(gateway, conn.session_id)
        await conn.response.create(
            response={
                "conversation": "none",
                "instructions": "Classify.",
                "metadata": {"topic": "triage"},
                "input": [
                    {"type": "item_reference", "id": kept.id},
                    user(
                        {"type": "input_image", "image_url": data_url(photo)}, text("side question")
                    ),
                ],
            }
        )
        done, events = await until(conn, "response.done")
        response = done.response
        assert response.conversation_id is None and response.metadata == {"topic": "triage"}
        assert "conversation_id" in response.model_fields_set  # sent as null
        assert events[0].type == "response.created"
        assert events[0].response.metadata == {"topic": "triage"}
        assert response.output[0].content[0].text == "side question [1 images]"
        assert response.usage.input_token_details.image_tokens > 0
        assert not [e for e in events if e.type.startswith("conversation.")]
        request = last_request(gateway)
        assert request.kv_key is None
        prompt = shown(request)
        assert prompt[0] == ("system", ["Classify."])
        assert prompt[1] == ("user", ["stored question"])
        assert prompt[2][1][1] == "side question" and prompt[2][1][0].startswith("<image")
        assert isinstance(request.messages[2].content[0], ImageInput)
        assert await stored_items(gateway, conn.session_id) == before

        # the conversation goes on as if the side question had never been asked
        await conn.response.create()
        done, _ = await until(conn, "response.done")
        assert done.response.conversation_id == conn.session_id
        assert shown(last_request(gateway)) == [("user", ["stored question"])]


async def test_out_of_band_input_is_checked(gateway: FakeGateway) -> None:
    cases = [
        ([{"type": "item_reference", "id": "item_nope"}], "item_not_found", "response.input[0].id"),
        (
            [{"type": "function_call_output", "call_id": "c1", "output": "x"}],
            "invalid_request",
            "response.input[0].call_id",
        ),
        ([user()], "invalid_request", "response.input[0].content"),
        ([], "invalid_request", "response.input"),  # nothing to answer: no items, no instructions
    ]
    async with realtime(gateway) as conn:
        for n, (items, code, param) in enumerate(cases):
            await conn.response.create(
                response={"conversation": "none", "input": items}, event_id=f"in{n}"
            )
            error = await error_of(conn, f"in{n}")
            assert (error.code, error.param) == (code, param)
        # a call and its result inside the input answer each other
        await conn.response.create(
            response={
                "conversation": "none",
                "input": [
                    {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c1"},
                    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                ],
            }
        )
        done, _ = await until(conn, "response.done")
        assert done.response.status == "completed"
        assert shown(last_request(gateway)) == [
            ("assistant", [render_tool_call("f", "{}")]),
            ("user", [render_tool_result("ok")]),
        ]


async def test_instructions_and_metadata_belong_to_one_response(gateway: FakeGateway) -> None:
    async with realtime(gateway) as conn:
        await conn.session.update(session={"type": "realtime", "instructions": "Session rules."})
        await until(conn, "session.updated")
        await add(conn, user(text("hi")))
        await conn.response.create(
            response={"instructions": "Just this once.", "metadata": {"run": "7"}}
        )
        created, _ = await until(conn, "response.created")
        done, _ = await until(conn, "response.done")
        assert created.response.metadata == done.response.metadata == {"run": "7"}
        assert shown(last_request(gateway))[0] == ("system", ["Just this once."])
        await conn.response.create()
        done, _ = await until(conn, "response.done")
        assert done.response.metadata is None
        assert shown(last_request(gateway))[0] == ("system", ["Session rules."])


async def test_a_resumed_session_shows_its_calls_and_results(gateway: FakeGateway) -> None:
    engine: ScriptedEngine = gateway.engine  # type: ignore[assignment]
    async with realtime(gateway) as conn:
        await add(conn, user(text("Weather in Paris?")))
        engine.script = [PARIS]
        await conn.response.create(response={"tools": [WEATHER], "tool_choice": "required"})
        done, _ = await until(conn, "response.done")
        [call] = done.response.output
        await add(conn, {"type": "function_call_output", "call_id": call.call_id, "output": "sun"})
        session_id = conn.session_id
    peer = await Peer.open(gateway.ws_url, session_id=session_id)
    try:
        items = peer.created["session"]["visiongate"]["items"]
    finally:
        await peer.close()
    assert [i["type"] for i in items] == ["message", "function_call", "function_call_output"]
    assert items[1] == {
        "type": "function_call",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
        "call_id": call.call_id,
        "id": call.id,
        "object": "realtime.item",
        "status": "completed",
    }
    assert (items[2]["call_id"], items[2]["output"]) == (call.call_id, "sun")


async def test_no_kv_warm_up_with_session_tools(gateway: FakeGateway) -> None:
    """A warm-up renders the conversation without the tools prompt: with session tools it
    would prefill a prefix no response uses, so none is started."""
    engine: ScriptedEngine = gateway.engine  # type: ignore[assignment]
    image = {"type": "input_image", "image_url": data_url(unique_photo("coffee"))}
    async with realtime(gateway) as conn:
        before = len(engine.warm_ups)
        await add(conn, user(image))
        await eventually(lambda: len(engine.warm_ups) > before)
        await conn.session.update(session={"type": "realtime", "tools": [WEATHER]})
        await until(conn, "session.updated")
        warmed = len(engine.warm_ups)
        rocket = {"type": "input_image", "image_url": data_url(unique_photo("rocket"))}
        await add(conn, user(rocket))
        await conn.response.create()  # the warm-up would have been scheduled before this ran
        await until(conn, "response.done")
    assert len(engine.warm_ups) == warmed


async def test_out_of_band_images_give_their_encode_slots_back(
    make_gateway: GatewayFactory,
) -> None:
    """An input's images hold encode slots only while their response runs: one response after
    another, each with a new image, is never refused under a cap of one pending encode."""
    small = make_gateway(
        settings=dict(max_pending_encodes_per_connection=1, max_pending_encodes_per_key=1)
    )
    async with realtime(small) as conn:
        for name in ("astronaut", "coffee", "chelsea"):
            image = {"type": "input_image", "image_url": data_url(unique_photo(name))}
            await conn.response.create(
                response={"conversation": "none", "input": [user(image, text("what?"))]}
            )
            done, _ = await until(conn, "response.done", "error")
            assert done.type == "response.done", done.error
            assert done.response.usage.input_token_details.image_tokens > 0
    assert small.state.require().vision.pending("anonymous") == 0
