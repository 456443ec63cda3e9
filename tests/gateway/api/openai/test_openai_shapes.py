"""Every Chat Completions shape the gateway sends, checked against the `openai` package's own
types: each body and chunk must validate (strictly) as the SDK's pydantic model, carry every
field OpenAI always sends even where the SDK would default it, and hold no field the SDK does
not know but visiongate's own `visiongate` extension and the reasoning servers' (vLLM, SGLang,
DeepSeek) `reasoning_content`, always null here. A drift of either side fails here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pydantic
import pytest
from openai.types import Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject

from gateway.testing.fake_gateway import GatewayFactory
from tests.gateway.api.openai.conftest import fake_http as http  # noqa: F401 - fixture
from tests.gateway.api.openai.test_chat_tools import PARIS, TWO_CALLS, WEATHER, ScriptedEngine

TIMEOUT = 10.0
MODEL = "fake-echo"
EXTENSIONS = {"visiongate"}
PEER_FIELDS = {"reasoning_content"}  # on messages and deltas, as vLLM and DeepSeek send it
HELLO = [{"role": "user", "content": "hello shapes"}]


def validated(model: type[pydantic.BaseModel], data: dict[str, Any]) -> pydantic.BaseModel:
    """`data` as the SDK's `model`, strictly; no unknown field anywhere but our extension."""
    parsed = model.model_validate(data, strict=True)
    _no_unknown_fields(parsed, model.__name__)
    return parsed


def _no_unknown_fields(value: object, where: str) -> None:
    if isinstance(value, pydantic.BaseModel):
        extra = set(value.model_extra or {}) - EXTENSIONS - PEER_FIELDS
        for name in PEER_FIELDS & set(value.model_extra or {}):
            assert value.model_extra[name] is None, f"{where}.{name} is {value.model_extra[name]}"
        assert not extra, f"{where}: fields the SDK does not know: {sorted(extra)}"
        for name in type(value).model_fields:
            _no_unknown_fields(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _no_unknown_fields(item, f"{where}[{i}]")


def has_keys(data: dict[str, Any], *keys: str) -> None:
    """Fields the SDK types leave optional but OpenAI always sends (some clients index them)."""
    missing = [k for k in keys if k not in data]
    assert not missing, f"missing {missing} in {sorted(data)}"


def check_completion(body: dict[str, Any]) -> ChatCompletion:
    completion = validated(ChatCompletion, body)
    has_keys(body, "id", "object", "created", "model", "choices", "usage", "system_fingerprint")
    for choice in body["choices"]:
        has_keys(choice, "index", "message", "finish_reason", "logprobs")
        has_keys(choice["message"], "role", "content", "refusal", "reasoning_content")
        if choice["logprobs"] is not None:
            has_keys(choice["logprobs"], "content", "refusal")
    has_keys(body["usage"], "prompt_tokens", "completion_tokens", "total_tokens")
    return completion  # type: ignore[return-value]


def check_chunks(lines: list[str], *, include_usage: bool) -> list[ChatCompletionChunk]:
    assert lines[-1] == "data: [DONE]"
    chunks = []
    for line in lines[:-1]:
        assert line.startswith("data: ")
        body = json.loads(line[len("data: ") :])
        chunks.append(validated(ChatCompletionChunk, body))
        has_keys(body, "id", "object", "created", "model", "choices", "system_fingerprint")
        assert ("usage" in body) == include_usage  # null until the last, or never there
        for choice in body["choices"]:
            has_keys(choice, "index", "delta", "finish_reason", "logprobs")
            # clients written for reasoning servers read it as an attribute of every delta
            has_keys(choice["delta"], "reasoning_content")
    assert len({c.id for c in chunks}) == 1
    return chunks  # type: ignore[return-value]


def sse(http: httpx.Client, body: dict[str, Any]) -> list[str]:
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]


@pytest.fixture
def scripted_http(make_gateway: GatewayFactory) -> Iterator[httpx.Client]:
    with make_gateway(engine=ScriptedEngine(TWO_CALLS)).http_client() as c:
        yield c


def test_a_plain_completion(http: httpx.Client) -> None:
    body = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO}).json()
    completion = check_completion(body)
    assert completion.object == "chat.completion"
    assert body["choices"][0]["logprobs"] is None and "tool_calls" not in body["choices"][0]
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None


def test_logprobs_and_n_choices(http: httpx.Client) -> None:
    request = {"model": MODEL, "messages": HELLO, "n": 3, "logprobs": True, "top_logprobs": 2}
    body = http.post("/v1/chat/completions", json=request).json()
    completion = check_completion(body)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    for choice in completion.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


def test_tool_calls(scripted_http: httpx.Client) -> None:
    request = {"model": MODEL, "messages": HELLO, "tools": [WEATHER]}
    body = scripted_http.post("/v1/chat/completions", json=request).json()
    completion = check_completion(body)
    message = completion.choices[0].message
    assert message.content is None and body["choices"][0]["message"]["content"] is None
    assert [c.type for c in message.tool_calls] == ["function", "function"]
    assert completion.choices[0].finish_reason == "tool_calls"


def test_streamed_chunks_with_usage_and_logprobs(http: httpx.Client) -> None:
    request = {
        "model": MODEL,
        "messages": HELLO,
        "n": 2,
        "logprobs": True,
        "stream_options": {"include_usage": True},
    }
    chunks = check_chunks(sse(http, request), include_usage=True)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    finishes = [ch for c in chunks for ch in c.choices if ch.finish_reason]
    assert sorted(ch.index for ch in finishes) == [0, 1]
    texts = [ch for c in chunks for ch in c.choices if ch.delta.content]
    assert texts and all(ch.logprobs is not None and ch.logprobs.content for ch in texts)


def test_streamed_chunks_without_usage(http: httpx.Client) -> None:
    chunks = check_chunks(sse(http, {"model": MODEL, "messages": HELLO}), include_usage=False)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_streamed_tool_calls(scripted_http: httpx.Client) -> None:
    request = {"model": MODEL, "messages": HELLO, "tools": [WEATHER]}
    chunks = check_chunks(sse(scripted_http, request), include_usage=False)
    calls = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or ()]
    assert [tc.index for tc in calls if tc.id] == [0, 1]
    assert all(tc.type == "function" and tc.function.name for tc in calls if tc.id)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_error_bodies_and_models(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400
    error = validated(ErrorObject, r.json()["error"])
    has_keys(r.json()["error"], "message", "type", "param", "code")
    assert error.code == "invalid_request"
    # beside the SDK's fields: what encodes the images, and the context, the served model and
    # its base as vLLM's cards name them
    extensions = EXTENSIONS | {"vision", "max_model_len", "root", "parent"}
    (card,) = http.get("/v1/models").json()["data"]
    assert isinstance(card["max_model_len"], int)
    assert card["root"] == card["id"] == MODEL and card["parent"] is None
    validated(Model, {k: v for k, v in card.items() if k not in extensions})
    # `default` names the served model, in a card's path as in a request's `model`
    assert http.get("/v1/models/default").json() == card
    r = http.post("/v1/chat/completions", json={"model": "default", "messages": HELLO})
    assert r.status_code == 200 and r.json()["model"] == MODEL
    assert http.get("/v1/models/other").status_code == 404


def test_a_scripted_answer_is_text_without_tools(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(engine=ScriptedEngine(PARIS))
    with httpx.Client(base_url=gateway.http_url, timeout=TIMEOUT) as c:
        body = c.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO}).json()
    check_completion(body)
    assert body["choices"][0]["message"]["content"] == PARIS  # no tools: nothing is a call
