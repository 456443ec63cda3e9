"""Tools, tool results, response formats, logprobs and n over Chat Completions, through the real
app with the official `openai` client, over an engine that answers a scripted text (the fake
engine's echo cannot write a tool call's newlines)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import openai
import pydantic
import pytest

from gateway.chat.tool_stream import render_tool_call, render_tool_result
from gateway.engine.interface import Delta, GenerationRequest, GenerationResult, TextDelta
from gateway.testing.fake_gateway import FakeGateway, GatewayFactory
from gateway.testing.fakes import FakeEngine
from tests.gateway.api.openai.conftest import fake_http as http  # noqa: F401 - fixture

TIMEOUT = 10.0
MODEL = "fake-echo"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
PARIS = render_tool_call("get_weather", '{"city": "Paris"}')
TWO_CALLS = PARIS + "\n" + render_tool_call("get_time", "{}")


class ScriptedEngine(FakeEngine):
    """Answers `answers[i]` for choice i (the last one for any further choice), five
    characters per delta, so a call's fixed text is split across deltas as a model's is."""

    def __init__(self, *answers: str, **knobs: object) -> None:
        super().__init__(**knobs)  # type: ignore[arg-type]
        self.answers = list(answers)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        self.requests.append(request)
        input_tokens, image_tokens = self._prompt_tokens(request)
        for index in range(request.sampling.n):
            text = self.answers[min(index, len(self.answers) - 1)]
            pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
            for piece in pieces:
                yield TextDelta(piece, index=index)
            yield GenerationResult(
                text, "stop", input_tokens, image_tokens, len(pieces), index=index
            )


@pytest.fixture
def scripted(make_gateway: GatewayFactory):
    """A gateway whose engine answers the given texts: `scripted(PARIS)`."""

    def start(*answers: str) -> tuple[FakeGateway, openai.OpenAI]:
        gateway = make_gateway(engine=ScriptedEngine(*answers))
        return gateway, gateway.openai_client()

    return start


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_tool_call_answer(scripted) -> None:
    gateway, client = scripted(PARIS)
    completion = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required"
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    # the model was told about the tools after the instructions, and held to the grammar
    request = gateway.engine.requests[-1]
    system = request.messages[0]
    assert system.role == "system" and "# Tools" in system.content[0]
    assert system.content[0].startswith(gateway.settings.default_instructions)
    assert '"name": "get_weather"' in system.content[0]
    assert request.sampling.grammar is not None and "get_weather" in request.sampling.grammar


def test_two_calls_and_text_around_them(scripted) -> None:
    _, client = scripted(TWO_CALLS)
    completion = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME])
    calls = completion.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2

    _, client = scripted("It is sunny in Paris.")
    completion = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    choice = completion.choices[0]
    assert choice.message.content == "It is sunny in Paris."
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"


def test_streamed_tool_calls_assemble_like_the_whole_answer(scripted) -> None:
    gateway, client = scripted(TWO_CALLS)
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME])
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=[WEATHER, TIME]) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    assert not [e for e in events if e.type == "content.delta" and e.delta]  # only calls
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [e.name for e in done] == ["get_weather", "get_time"]
    # the assembled message goes back as the history, with a result for each call
    results = [
        {"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in streamed.message.tool_calls
    ]
    followup = client.chat.completions.create(
        model=MODEL, messages=[*ASK, streamed.message, *results], tools=[WEATHER, TIME]
    )
    assert followup.choices[0].message.tool_calls

    # the wire: a call's first delta names it, the next ones carry pieces of the arguments
    gateway.engine.answers = [PARIS]
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "stream": True}
    with (
        httpx.Client(base_url=gateway.http_url, timeout=TIMEOUT) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    calls = [
        c["choices"][0]["delta"]["tool_calls"][0]
        for c in chunks
        if "tool_calls" in c["choices"][0]["delta"]
    ]
    first, rest = calls[0], calls[1:]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert rest and all(set(c) == {"index", "function"} for c in rest)
    assert "".join(c["function"]["arguments"] for c in rest) == '{"city": "Paris"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_tool_round_trip_keeps_the_session(scripted) -> None:
    gateway, client = scripted(PARIS)
    session = {"session_id": "tools-round-trip"}
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], extra_body=session
    )
    message = first.choices[0].message
    call = message.tool_calls[0]
    url = f"{gateway.http_url}/v1/sessions/tools-round-trip"
    stored = [i["id"] for i in httpx.get(url, timeout=TIMEOUT).json()["items"]]
    history = [
        *ASK,
        message,  # the SDK's own object, sent back as it is
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
    ]
    gateway.engine.answers = ["Clear skies."]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], extra_body=session
    )
    assert second.choices[0].message.content == "Clear skies."

    # the replayed assistant message matched the stored answer: its items were kept
    view = httpx.get(url, timeout=TIMEOUT).json()
    assert [i["role"] for i in view["items"]] == ["user", "assistant", "tool", "assistant"]
    assert [i["id"] for i in view["items"][:2]] == stored
    # the model saw its call as it wrote it, and the result as the user's turn
    request = gateway.engine.requests[-1]
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "user"]
    assert request.messages[2].content == [PARIS]
    assert request.messages[3].content == [render_tool_result('{"sky": "clear"}')]
    assert request.kv_key == gateway.engine.requests[-2].kv_key is not None


def test_a_replayed_call_that_differs_replaces_the_history(scripted) -> None:
    gateway, client = scripted(PARIS)
    session = {"session_id": "tools-diverging"}
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], extra_body=session
    )
    url = f"{gateway.http_url}/v1/sessions/tools-diverging"
    stored = [i["id"] for i in httpx.get(url, timeout=TIMEOUT).json()["items"]]
    replayed = first.choices[0].message.model_dump(exclude_none=True)
    replayed["tool_calls"][0]["function"]["arguments"] = '{"city": "Lyon"}'
    history = [
        *ASK,
        replayed,
        {"role": "tool", "tool_call_id": replayed["tool_calls"][0]["id"], "content": "rain"},
    ]
    client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], extra_body=session
    )
    view = httpx.get(url, timeout=TIMEOUT).json()
    assert view["items"][0]["id"] != stored[0]  # not the stored conversation: replaced


def test_tool_choice_none_lists_the_tools_but_allows_only_text(scripted) -> None:
    gateway, client = scripted(PARIS)
    completion = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none"
    )
    # nothing is read as a call: the text is the answer
    assert completion.choices[0].message.content == PARIS
    assert completion.choices[0].message.tool_calls is None
    request = gateway.engine.requests[-1]
    # the same system prompt as under "auto" (a conversation that called the tools keeps its
    # KV prefix); the grammar alone keeps the answer plain text
    client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto")
    auto = gateway.engine.requests[-1]
    assert "# Tools" in request.messages[0].content[0]
    assert request.messages[0].content == auto.messages[0].content
    grammar = request.sampling.grammar
    assert grammar is not None and grammar != auto.sampling.grammar
    assert "calls" not in grammar.splitlines()[0]


def test_a_named_tool_choice(scripted) -> None:
    gateway, client = scripted(PARIS)
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert completion.choices[0].message.tool_calls[0].function.name == "get_weather"
    grammar = gateway.engine.requests[-1].sampling.grammar
    assert "get_weather" in grammar and "get_time" not in grammar


class Weather(pydantic.BaseModel):
    city: str
    sunny: bool


def test_parse_with_a_response_format(scripted) -> None:
    gateway, client = scripted('{"city": "Paris", "sunny": true}')
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Weather)
    assert completion.choices[0].message.parsed == Weather(city="Paris", sunny=True)
    grammar = gateway.engine.requests[-1].sampling.grammar
    assert grammar is not None and '"sunny"' in grammar

    client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}
    )
    assert gateway.engine.requests[-1].sampling.grammar is not None
    client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "text"})
    assert gateway.engine.requests[-1].sampling.grammar is None


def test_n_choices_with_logprobs(http: httpx.Client, fake_gateway: FakeGateway) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "one two"}],
        "n": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    completion = r.json()
    choices = completion["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["message"]["content"] for c in choices] == [
        "one two [0 images]",
        "one two [0 images] #1",
        "one two [0 images] #2",
    ]
    assert completion["usage"]["completion_tokens"] == 3 + 4 + 4
    for c in choices:
        tokens = c["logprobs"]["content"]
        assert "".join(t["token"] for t in tokens) == c["message"]["content"]
        assert all(len(t["top_logprobs"]) == 2 for t in tokens)
        assert all(bytes(t["bytes"]).decode() == t["token"] for t in tokens)
        assert c["logprobs"]["refusal"] is None
    assert fake_gateway.engine.requests[-1].sampling.n == 3
    assert fake_gateway.engine.requests[-1].sampling.logprobs == 2


def test_n_choices_streamed(fake_gateway: FakeGateway) -> None:
    client = fake_gateway.openai_client()

    with client.chat.completions.stream(
        model=MODEL,
        messages=[{"role": "user", "content": "a b"}],
        n=2,
        logprobs=True,
        stream_options={"include_usage": True},
    ) as stream:
        final = stream.get_final_completion()
    assert [c.message.content for c in final.choices] == ["a b [0 images]", "a b [0 images] #1"]
    assert all(c.finish_reason == "stop" for c in final.choices)
    assert final.usage.completion_tokens == 3 + 4
    for c in final.choices:
        assert "".join(t.token for t in c.logprobs.content) == c.message.content


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"tool_choice": "required"}, 400, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            400,
            "tool_choice.function.name",
        ),
        ({"tools": [{"type": "retrieval"}]}, 400, "tools[0].type"),
        ({"functions": [WEATHER["function"]]}, 400, "functions"),
        ({"function_call": "auto"}, 400, "function_call"),
        ({"response_format": {"type": "xml"}}, 400, "response_format.type"),
        ({"top_logprobs": 3}, 400, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"n": 0}, 400, "n"),
        ({"n": 9}, 400, "n"),
    ],
)
def test_refused_tool_and_sampling_fields(
    http: httpx.Client, extra: dict, status: int, param: str
) -> None:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **extra})
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == "invalid_request"
    assert r.json()["error"]["param"] == param


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([*ASK, {"role": "tool", "content": "sunny"}], "messages[1].tool_call_id"),
        (
            [*ASK, {"role": "tool", "tool_call_id": "call_1", "content": "x"}],
            "messages[1].tool_call_id",
        ),
        ([{"role": "user", "content": "q", "tool_calls": [CALL]}], "messages[0].tool_calls"),
        (
            [
                *ASK,
                {
                    "role": "assistant",
                    "content": None,
                    "function_call": {"name": "f", "arguments": "{}"},
                },
            ],
            "messages[1].function_call",
        ),
        (
            [*ASK, {"role": "assistant", "tool_calls": [{**CALL, "id": ""}]}],
            "messages[1].tool_calls[0].id",
        ),
        (
            [
                *ASK,
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1"},
            ],
            "messages[2].content",
        ),
    ],
)
def test_refused_tool_messages(http: httpx.Client, messages: list[dict], param: str) -> None:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request"
    assert r.json()["error"]["param"] == param


def test_instructions_alone_are_answered(http: httpx.Client, fake_gateway: FakeGateway) -> None:
    body = {"model": MODEL, "messages": [{"role": "system", "content": "Say hi."}]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    request = fake_gateway.engine.requests[-1]
    assert [m.role for m in request.messages] == ["system"]
    assert request.messages[0].content == ["Say hi."]


FN = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": "x"},
        {"tools": [1]},
        {"tools": [{"type": "function"}]},
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        {"tools": [{"type": "function", "function": {"name": "a", "parameters": "x"}}]},
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "a",
                        "strict": True,
                        "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}},
                    },
                }
            ]
        },
        {"tools": [FN, FN]},
        {"tools": [FN], "tool_choice": 5},
        {"tools": [FN], "tool_choice": {"type": "function"}},
        {"tools": [FN], "tool_choice": {"type": "function", "function": "f"}},
        {"tools": [FN], "parallel_tool_calls": "yes"},
        {"response_format": "json"},
        {"response_format": {"type": "json_schema"}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        {"logprobs": "yes"},
        {"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": 1}]}]},
        {"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "a", "function": {}}]}]},
        {"messages": [*ASK, {"role": "assistant", "tool_calls": "x"}]},
        {"messages": [*ASK, {"role": "tool", "tool_call_id": 7, "content": "x"}]},
    ],
)
def test_malformed_tool_fields_are_refused_never_a_crash(http: httpx.Client, extra: dict) -> None:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request" and r.json()["error"]["param"]
