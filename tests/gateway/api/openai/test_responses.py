"""The Responses API (`/v1/responses`) through the real app over the fake engine and encoder:
request checks, wire shapes (validated against the `openai` package's own types), chains over
sessions (append, fork, store=false), stored responses, streaming, a client that goes away.
`/v1/completions` is in `test_completions.py`, the response-record store in
`tests/gateway/sessions/test_response_records.py`."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.api.openai.responses import protocol as r
from gateway.api.openai.responses.inputs import ParsedInput
from gateway.api.openai.responses.output_builder import OutputBuilder
from gateway.api.openai.responses.serving import Prepared
from gateway.chat.events import Finished, ResponseOptions, TextChunk
from gateway.chat.tool_stream import call_id, render_tool_call
from gateway.engine.interface import EngineError, TokenLogprob
from gateway.sessions.session import Session
from gateway.testing.fake_gateway import FakeGateway, GatewayFactory, eventually
from gateway.testing.fakes import FakeEngine
from gateway.testing.realtime_peer import data_url
from tests.conftest import unique_photo
from tests.gateway.api.openai.conftest import fake_http as http  # noqa: F401 - fixture
from tests.gateway.api.openai.conftest import fake_openai as client  # noqa: F401 - fixture
from tests.gateway.api.openai.conftest import sse

TIMEOUT = 10.0
MODEL = "fake-echo"
EVENTS = TypeAdapter(ResponseStreamEvent)
ITEMS = TypeAdapter(ResponseItem)


def session_of(gateway: FakeGateway, session_id: str) -> Session:
    return asyncio.run(gateway.state.sessions.load(session_id, "anonymous"))


def texts(response: dict[str, Any]) -> list[str]:
    return [c["text"] for item in response["output"] for c in item.get("content", [])]


# ---------------------------------------------------------------- shapes


def test_response_object_matches_the_sdk_types(http: httpx.Client, client: openai.OpenAI) -> None:
    reply = http.post(
        "/v1/responses",
        json={"model": MODEL, "input": "hello there", "metadata": {"run": "7"}, "user": "u1"},
    )
    assert reply.status_code == 200
    body = reply.json()
    response = Response.model_validate(body)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.model == MODEL
    assert response.output_text == "hello there [0 images]"
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed" and message.id.startswith("msg_")
    usage = response.usage
    assert usage is not None and usage.output_tokens == 3
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.metadata == {"run": "7"} and response.tool_choice == "auto"
    assert response.truncation == "disabled" and response.parallel_tool_calls is True
    assert "output_text" not in body  # an SDK property, never sent
    ext = body["visiongate"]
    assert ext["session_id"].startswith("sess_") and ext["stored"] is True
    assert set(ext["timings"]) >= {"ttft_ms", "total_ms"}

    # the SDK's own call gives the same answer
    again = client.responses.create(model=MODEL, input="hello there")
    assert again.output_text == response.output_text and again.id != response.id


def test_stream_events_in_order_match_the_sdk_and_the_plain_answer(
    http: httpx.Client, client: openai.OpenAI
) -> None:
    body = {"model": MODEL, "input": "stream these words", "stream": True}
    frames = sse(http, "/v1/responses", body)
    events = [EVENTS.validate_python(json.loads(data)) for _, data in frames]
    assert [name for name, _ in frames] == [e.type for e in events]  # `event:` is the type
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 4 and "".join(deltas) == "stream these words [0 images]"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = events[-1].response
    plain = client.responses.create(model=MODEL, input="stream these words")
    assert done.output_text == plain.output_text
    assert [(i.type, i.status) for i in done.output] == [(i.type, i.status) for i in plain.output]
    assert done.id == events[0].response.id

    # the SDK's stream reads the same events
    streamed = list(client.responses.create(model=MODEL, input="stream these words", stream=True))
    assert [e.type for e in streamed] == kinds


def _weather_call_prepared(options: ResponseOptions) -> Prepared:
    """A prepared, unstored response offering one function tool (for `OutputBuilder` alone)."""
    request = r.ResponsesRequest(
        model=MODEL,
        input="weather?",
        tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
    )
    return Prepared(
        request=request,
        owner="anonymous",
        options=options,
        session=Session.new("anonymous", instructions="", max_output_tokens=16),
        stored=False,
        created=False,
        forked=False,
        parsed=ParsedInput(),
        permit=None,  # type: ignore[arg-type]
        created_at=1,
        model=MODEL,
    )


def test_tool_calls_become_function_call_items_and_events() -> None:
    """The model's calls (read from its text as it streams) are function_call items, their
    arguments streamed as deltas; the events and the response validate as the SDK's types."""
    options = ResponseOptions(tools=True, item_id="msg_1", logprobs=None)
    prepared = _weather_call_prepared(options)
    answer = "Let me check." + render_tool_call("get_weather", '{"city": "Paris"}')
    out = OutputBuilder(prepared)
    for at in range(0, len(answer), 7):  # in pieces that cut the call's tags apart
        out.feed(TextChunk(answer[at : at + 7]))
    finished = Finished(options.response_id, options.item_id, "completed", answer)
    response = out.finish(finished)
    events = [EVENTS.validate_python(json.loads(frame.split(b"data: ")[1])) for frame in out.take()]
    kinds = [e.type for e in events]
    assert kinds[0] == "response.output_item.added"
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]
    arguments = "".join(e.delta for e in events if e.type.endswith("arguments.delta"))
    assert arguments == '{"city": "Paris"}'
    sdk = Response.model_validate(json.loads(_encode(response)))
    message, call = sdk.output
    assert message.type == "message" and sdk.output_text == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments == '{"city": "Paris"}'
    assert call.call_id == call_id(options.response_id, 0)
    assert {e.output_index for e in events if getattr(e, "item_id", None) == call.id} == {1}


def test_an_answer_that_is_only_a_call_is_one_function_call_item() -> None:
    """No empty message before or after the call: the SDK's stream helper requires every item
    at its own output index."""
    options = ResponseOptions(tools=True, item_id="msg_1", logprobs=0)
    prepared = _weather_call_prepared(options)
    answer = render_tool_call("get_weather", '{"city": "Paris"}')
    out = OutputBuilder(prepared)
    out.feed(TextChunk(answer))
    tail = (TokenLogprob("<", -0.1, b"<"),)  # tokens the call held back still end it cleanly
    response = out.finish(
        Finished(options.response_id, options.item_id, "completed", answer, logprobs=tail)
    )
    events = [EVENTS.validate_python(json.loads(frame.split(b"data: ")[1])) for frame in out.take()]
    sdk = Response.model_validate(json.loads(_encode(response)))
    assert [i.type for i in sdk.output] == ["function_call"]
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [(e.output_index, e.item.type) for e in added] == [(0, "function_call")]


def _encode(value: object) -> bytes:
    import msgspec

    return msgspec.json.encode(value)


# ---------------------------------------------------------------- chains over sessions


def test_a_chain_appends_to_its_session_and_a_fork_copies_it(
    client: openai.OpenAI, fake_gateway: FakeGateway
) -> None:
    photo = unique_photo("coffee")
    first = client.responses.create(
        model=MODEL,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(photo)},
                    {"type": "input_text", "text": "what is this"},
                ],
            }
        ],
    )
    assert first.output_text == "what is this [1 images]"
    session_id = first.model_extra["visiongate"]["session_id"]
    second = client.responses.create(
        model=MODEL, input="and the colour", previous_response_id=first.id
    )
    ext2 = second.model_extra["visiongate"]
    assert ext2["session_id"] == session_id and not ext2.get("forked")
    assert ext2["cache"]["vision"] == "hit"  # the chain's image, from the vision cache
    roles = [i.role for i in session_of(fake_gateway, session_id).items]
    assert roles == ["user", "assistant", "user", "assistant"]

    # continuing the first response again: its session has moved on, so the chain forks
    fork = client.responses.create(model=MODEL, input="a fork", previous_response_id=first.id)
    ext3 = fork.model_extra["visiongate"]
    assert ext3["forked"] is True and ext3["session_id"] != session_id
    prompt = fake_gateway.engine.requests[-1].messages
    said = [(m.role, [c for c in m.content if isinstance(c, str)]) for m in prompt]
    assert said[-3:] == [
        ("user", ["what is this"]),
        ("assistant", ["what is this [1 images]"]),
        ("user", ["a fork"]),
    ]  # the first response's conversation, not the other branch's
    assert len(session_of(fake_gateway, session_id).items) == 4  # the original is untouched

    # the second response is still at the end of the original session: no fork
    third = client.responses.create(model=MODEL, input="go on", previous_response_id=second.id)
    assert third.model_extra["visiongate"]["session_id"] == session_id
    assert len(session_of(fake_gateway, session_id).items) == 6


def test_concurrent_continuations_of_one_response_fork(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(engine=FakeEngine(delay_s=0.05))
    with openai.OpenAI(
        base_url=f"{gateway.http_url}/v1", api_key="x", timeout=TIMEOUT, max_retries=0
    ) as sdk:
        first = sdk.responses.create(model=MODEL, input="start here")
        barrier = threading.Barrier(2)
        results: list[Response] = []

        def go(words: str) -> None:
            barrier.wait()
            results.append(
                sdk.responses.create(model=MODEL, input=words, previous_response_id=first.id)
            )

        threads = [threading.Thread(target=go, args=(w,)) for w in ("left branch", "right one")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(x.output_text for x in results) == [
        "left branch [0 images]",
        "right one [0 images]",
    ]
    exts = [x.model_extra["visiongate"] for x in results]
    assert sorted(bool(e.get("forked")) for e in exts) == [False, True]
    assert exts[0]["session_id"] != exts[1]["session_id"]
    for ext, result in zip(exts, results, strict=True):
        items = session_of(gateway, ext["session_id"]).items
        said = [p.text for item in items for p in item.parts]
        assert said == [
            "start here",
            "start here [0 images]",
            result.output_text.removesuffix(" [0 images]"),
            result.output_text,
        ]


def test_instructions_belong_to_one_response(
    client: openai.OpenAI, fake_gateway: FakeGateway
) -> None:
    first = client.responses.create(model=MODEL, input="one", instructions="Speak like a pirate.")
    assert fake_gateway.engine.requests[-1].messages[0].content == ["Speak like a pirate."]
    assert first.instructions == "Speak like a pirate."
    second = client.responses.create(model=MODEL, input="two", previous_response_id=first.id)
    prompt = fake_gateway.engine.requests[-1].messages
    assert all("Speak like a pirate." not in m.content for m in prompt)
    assert second.instructions is None


def test_store_false_leaves_nothing_behind(
    client: openai.OpenAI, fake_gateway: FakeGateway
) -> None:
    sessions = fake_gateway.state.sessions
    before = asyncio.run(sessions.count())
    first = client.responses.create(model=MODEL, input="keep this")
    session_id = first.model_extra["visiongate"]["session_id"]
    gone = client.responses.create(
        model=MODEL, input="not this", store=False, previous_response_id=first.id
    )
    assert gone.output_text == "not this [0 images]"
    assert gone.model_extra["visiongate"].get("session_id") is None
    assert fake_gateway.engine.requests[-1].kv_key is None  # no KV kept for it
    said = [m.content for m in fake_gateway.engine.requests[-1].messages]
    assert ["keep this"] in said  # it saw the chain
    assert len(session_of(fake_gateway, session_id).items) == 2  # which it did not change
    assert asyncio.run(sessions.count()) == before + 1
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", previous_response_id=gone.id)
    assert info.value.body["code"] == "previous_response_not_found"


def test_unknown_and_foreign_responses_are_not_found(
    client: openai.OpenAI, make_gateway: GatewayFactory
) -> None:
    with pytest.raises(openai.BadRequestError) as info:  # a bad value, as OpenAI answers it
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert info.value.body["code"] == "previous_response_not_found"
    assert info.value.body["type"] == "invalid_request_error"
    assert info.value.body["param"] == "previous_response_id"

    gateway = make_gateway(settings=dict(api_keys=["key-a", "key-b"]))
    url = f"{gateway.http_url}/v1"
    with (
        openai.OpenAI(base_url=url, api_key="key-a", timeout=TIMEOUT, max_retries=0) as a,
        openai.OpenAI(base_url=url, api_key="key-b", timeout=TIMEOUT, max_retries=0) as b,
    ):
        mine = a.responses.create(model=MODEL, input="private words")
        for attempt in (
            lambda: b.responses.retrieve(mine.id),
            lambda: b.responses.delete(mine.id),
            lambda: b.responses.input_items.list(mine.id),
        ):
            with pytest.raises(openai.NotFoundError) as info:
                attempt()
            assert info.value.body["code"] == "response_not_found"
        with pytest.raises(openai.BadRequestError) as info:  # reads as an unknown id
            b.responses.create(model=MODEL, input="x", previous_response_id=mine.id)
        assert info.value.body["code"] == "previous_response_not_found"
        assert a.responses.retrieve(mine.id).output_text == "private words [0 images]"


def test_function_call_history_is_stored_as_tool_items(
    client: openai.OpenAI, fake_gateway: FakeGateway
) -> None:
    response = client.responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": "weather in Paris"},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Checking.", "annotations": []}
            ]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"role": "user", "content": [{"type": "input_text", "text": "so what now"}]},
        ],
    )  # fmt: skip
    assert response.output_text == "so what now [0 images]"
    items = session_of(fake_gateway, response.model_extra["visiongate"]["session_id"]).items
    assert [i.role for i in items] == ["system", "user", "assistant", "tool", "user", "assistant"]
    assistant, tool = items[2], items[3]
    assert [p.kind for p in assistant.parts] == ["text", "tool_call"]
    call = assistant.parts[1]
    assert (call.name, call.call_id, call.text) == ("get_weather", "call_1", '{"city": "Paris"}')
    assert (tool.parts[0].text, tool.parts[0].call_id) == ("sunny", "call_1")

    listed = client.responses.input_items.list(response.id, order="asc")
    kinds = [(i.type, getattr(i, "role", None)) for i in listed.data]
    assert kinds == [
        ("message", "developer"),
        ("message", "user"),
        ("message", "assistant"),
        ("function_call", None),
        ("function_call_output", None),
        ("message", "user"),
    ]


def test_tools_and_text_format_reach_the_engine(
    client: openai.OpenAI, fake_gateway: FakeGateway
) -> None:
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "strict": True,
        }
    ]
    response = client.responses.create(
        model=MODEL, input="weather in Paris", tools=tools, tool_choice="required"
    )
    request = fake_gateway.engine.requests[-1]
    assert request.sampling.grammar is not None
    assert "get_weather" in request.messages[0].content[0]  # the tools prompt
    assert response.tool_choice == "required" and response.tools[0].name == "get_weather"

    schema = {
        "type": "json_schema",
        "name": "city",
        "schema": {"type": "object", "properties": {"name": {"type": "string"}}},
    }
    shaped = client.responses.create(model=MODEL, input="a city", text={"format": schema})
    request = fake_gateway.engine.requests[-1]
    assert request.sampling.grammar is not None
    assert all("get_weather" not in str(m.content) for m in request.messages)
    assert shaped.text.format.type == "json_schema" and shaped.text.format.name == "city"


def test_a_chain_on_redis(make_gateway: GatewayFactory, redis_url: str, raw_redis: Any) -> None:
    """Sessions and response records in Redis: a chain, a fork and a retrieval."""
    gateway = make_gateway(settings=dict(redis_url=redis_url))
    with openai.OpenAI(
        base_url=f"{gateway.http_url}/v1", api_key="x", timeout=TIMEOUT, max_retries=0
    ) as sdk:
        first = sdk.responses.create(model=MODEL, input="on redis")
        second = sdk.responses.create(model=MODEL, input="next", previous_response_id=first.id)
        fork = sdk.responses.create(model=MODEL, input="fork", previous_response_id=first.id)
        ext1, ext2, ext3 = (x.model_extra["visiongate"] for x in (first, second, fork))
        assert ext2["session_id"] == ext1["session_id"] != ext3["session_id"]
        assert ext3["forked"] is True
        assert sdk.responses.retrieve(second.id).output_text == "next [0 images]"
        assert raw_redis.exists(f"vg:response:anonymous:{second.id}")
        sdk.responses.delete(second.id)
        assert not raw_redis.exists(f"vg:response:anonymous:{second.id}")


# ---------------------------------------------------------------- stored responses


def test_retrieve_input_items_and_delete(client: openai.OpenAI, http: httpx.Client) -> None:
    photo = unique_photo("chelsea")
    created = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "first words"},
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(photo), "detail": "low"},
                    {"type": "input_text", "text": "a cat"},
                ],
            },
        ],
    )
    got = client.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump()

    page = http.get(f"/v1/responses/{created.id}/input_items").json()
    assert page["object"] == "list" and not page["has_more"]
    items = [ITEMS.validate_python(i) for i in page["data"]]
    assert [i.content[0].type for i in items] == ["input_image", "input_text"]  # newest first
    assert items[0].content[0].image_url.startswith("visiongate:sha256:")
    first = http.get(f"/v1/responses/{created.id}/input_items?order=asc&limit=1").json()
    assert first["has_more"] and first["data"][0]["content"][0]["text"] == "first words"
    rest = http.get(
        f"/v1/responses/{created.id}/input_items",
        params={"order": "asc", "after": first["last_id"]},
    ).json()
    assert [i["id"] for i in rest["data"]] == [page["data"][0]["id"]]

    deleted = http.delete(f"/v1/responses/{created.id}")
    assert deleted.json() == {"id": created.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(created.id)
    assert info.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)


# ---------------------------------------------------------------- request checks


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"model": "gpt-4o", "input": "x"}, 404, "model_not_found", "model"),
        ({"input": "x", "frobnicate": 1}, 400, "invalid_request", "frobnicate"),
        ({"input": []}, 400, "invalid_request", "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f1"}]}]},
            400,
            "invalid_request",
            "input[0].content[0].file_id",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            400,
            "invalid_request",
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "invalid_request",
         "input[0].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, 400, "invalid_request",
         "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
            400,
            "invalid_request",
            "input[0].content[0].text",
        ),
        (
            {"input": [{"role": "assistant", "content": [{"type": "input_image",
                                                          "image_url": "data:,"}]}]},
            400,
            "invalid_request",
            "input[0].content[0].type",
        ),
        ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "invalid_request",
         "metadata"),
        ({"input": "x", "metadata": {"k": "v" * 513}}, 400, "invalid_request", "metadata.k"),
        ({"input": "x", "background": True}, 400, "invalid_request", "background"),
        ({"input": "x", "conversation": "conv_1"}, 400, "invalid_request", "conversation"),
        ({"input": "x", "max_tool_calls": 2}, 400, "invalid_request", "max_tool_calls"),
        ({"input": "x", "top_logprobs": 21}, 400, "invalid_request", "top_logprobs"),
        ({"input": "x", "temperature": 3}, 400, "invalid_request", "temperature"),
        ({"input": "x", "max_output_tokens": 0}, 400, "invalid_request", "max_output_tokens"),
        ({"input": "x", "truncation": "sometimes"}, 400, "invalid_request", "truncation"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, 400, "invalid_request",
         "text.format.type"),
        ({"input": "x", "tool_choice": "required"}, 400, "invalid_request", "tool_choice"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "invalid_request",
         "tools[0].type"),
    ],
)  # fmt: skip
def test_bad_requests_get_a_clear_error(
    http: httpx.Client, body: dict[str, Any], status: int, code: str, param: str
) -> None:
    reply = http.post("/v1/responses", json={"model": MODEL, **body})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert error["message"]


def test_ignored_parameters_are_accepted(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input="fine",
        user="someone",
        service_tier="auto",
        safety_identifier="s",
        prompt_cache_key="k",
        reasoning={"effort": "low"},
        truncation="auto",
        text={"format": {"type": "text"}},
        tool_choice="none",
    )
    assert response.output_text == "fine [0 images]"
    notes = response.model_extra["visiongate"]["notes"]
    assert any("reasoning" in n for n in notes)


def test_logprobs_when_asked(client: openai.OpenAI, http: httpx.Client) -> None:
    response = client.responses.create(
        model=MODEL,
        input="two words",
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    logprobs = response.output[0].content[0].logprobs
    assert [t.token for t in logprobs] == ["two", " words", " [0 images]"]
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in logprobs)
    assert bytes(logprobs[1].bytes) == b" words"
    plain = client.responses.create(model=MODEL, input="two words")
    assert plain.output[0].content[0].logprobs is None

    body = {"model": MODEL, "input": "two words", "stream": True, "top_logprobs": 0}
    events = [json.loads(data) for _, data in sse(http, "/v1/responses", body)]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [t["token"] for d in deltas for t in d["logprobs"]] == ["two", " words", " [0 images]"]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert len(done["logprobs"]) == 3


# ---------------------------------------------------------------- faults


def test_failures_before_and_after_output(make_gateway: GatewayFactory) -> None:
    engine = FakeEngine(
        refuse=EngineError("the prompt is too long", code="context_length_exceeded")
    )
    gateway = make_gateway(engine=engine)
    sessions = gateway.state.sessions
    with (
        openai.OpenAI(
            base_url=f"{gateway.http_url}/v1", api_key="x", timeout=TIMEOUT, max_retries=0
        ) as sdk,
        httpx.Client(base_url=gateway.http_url, timeout=TIMEOUT) as http,
    ):
        # before any output: the HTTP status of the error, and the chain as it was
        with pytest.raises(openai.BadRequestError) as info:
            sdk.responses.create(model=MODEL, input="a b c")
        assert info.value.body["code"] == "context_length_exceeded"
        assert asyncio.run(sessions.count()) == 0  # the session it started is gone
        engine.refuse = None
        first = sdk.responses.create(model=MODEL, input="a b c")
        session_id = first.model_extra["visiongate"]["session_id"]
        engine.refuse = EngineError("no", code="context_length_exceeded")
        with pytest.raises(openai.BadRequestError):
            sdk.responses.create(model=MODEL, input="more", previous_response_id=first.id)
        assert len(session_of(gateway, session_id).items) == 2  # its input was taken back
        engine.refuse = None

        # after output: the response fails (stream: response.failed; plain: status failed)
        engine.fail_after = 2
        frames = sse(http, "/v1/responses", {"model": MODEL, "input": "a b c d", "stream": True})
        events = [EVENTS.validate_python(json.loads(data)) for _, data in frames]
        assert events[-1].type == "response.failed"
        failed = events[-1].response
        assert failed.status == "failed" and failed.error is not None
        assert failed.error.code == "server_error" and failed.error.type == "engine_error"
        plain = sdk.responses.create(model=MODEL, input="a b c d")
        assert plain.status == "failed" and plain.error.type == "engine_error"
        assert sdk.responses.retrieve(plain.id).status == "failed"


def test_a_client_that_disconnects_cancels_generation(make_gateway: GatewayFactory) -> None:
    engine = FakeEngine(delay_s=0.05)
    gateway = make_gateway(engine=engine)
    body = {"model": MODEL, "input": " ".join(["word"] * 200), "stream": True}
    with (
        httpx.Client(base_url=gateway.http_url, timeout=TIMEOUT) as http,
        http.stream("POST", "/v1/responses", json=body) as reply,
    ):
        for line in reply.iter_lines():
            if "output_text.delta" in line:
                break
    asyncio.run(eventually(lambda: engine.running == 0))
    assert engine.requests[-1].cancel.is_set()


@pytest.mark.parametrize("route", ["responses", "completions"])
async def test_a_client_gone_before_a_non_streamed_answer_cancels_it(
    make_gateway: GatewayFactory, route: str
) -> None:
    engine = FakeEngine(delay_s=0.2)  # 400 words: over a minute unless cancelled
    gateway = make_gateway(engine=engine)
    words = " ".join(f"w{i}" for i in range(400))
    if route == "responses":
        body: dict[str, Any] = {"model": MODEL, "input": words, "max_output_tokens": 400}
    else:
        body = {"model": MODEL, "prompt": [words, words], "n": 2, "max_tokens": 400}
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"/v1/{route}", json=body)
    # every generation the request started stops, long before its 80 s of words
    await eventually(
        lambda: bool(engine.requests) and all(r.cancel.is_set() for r in engine.requests)
    )
    await eventually(lambda: engine.running == 0)
