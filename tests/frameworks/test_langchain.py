"""LangChain's `ChatOpenAI` (langchain-openai) against the real gateway over TLS: images,
streaming, batches, tools (a `ToolMessage` round trip, streamed calls), structured output by
JSON schema, function calling and JSON mode, logprobs, usage with cached tokens, and the
Responses API mode. Answers are greedy, so a streamed answer equals the one invoked."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.frameworks.conftest import API_KEY

pytestmark = pytest.mark.slow

ASK = [HumanMessage("Name one colour of the sky.")]


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny and 21 C in {city}."


class Capital(BaseModel):
    """A country and its capital city."""

    country: str = Field(description="the country")
    capital: str = Field(description="its capital city")


@pytest.fixture(scope="module")
def chat(
    base_url: str,
    model_id: str,
    https_client: httpx.Client,
    async_https_client: httpx.AsyncClient,
) -> Any:
    def make(**kwargs: Any) -> ChatOpenAI:
        options: dict[str, Any] = dict(max_tokens=12, max_retries=0, timeout=300)
        options.update(kwargs)
        return ChatOpenAI(
            model=model_id,
            base_url=base_url,
            api_key=API_KEY,
            http_client=https_client,
            http_async_client=async_https_client,
            **options,
        )

    return make


def test_invoke_with_an_image_stream_and_batch(chat: Any, photo_url: str) -> None:
    llm = chat()
    look = HumanMessage(
        content=[
            {"type": "text", "text": "What is in this photo?"},
            {"type": "image_url", "image_url": {"url": photo_url}},
        ]
    )
    seen = llm.invoke([look])
    assert isinstance(seen, AIMessage) and seen.content
    assert seen.response_metadata["finish_reason"] in ("stop", "length")
    usage = seen.usage_metadata
    assert usage is not None and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens"] > 50  # the image's tokens are in the prompt

    answer = llm.invoke(ASK)
    chunks = list(chat(stream_usage=True).stream(ASK))
    assert len(chunks) > 2
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    assert streamed.content == answer.content  # greedy: the same answer
    assert streamed.usage_metadata is not None
    assert streamed.usage_metadata["output_tokens"] == answer.usage_metadata["output_tokens"]

    batch = llm.batch([ASK, [HumanMessage("Say hello.")]])
    assert batch[0].content == answer.content and batch[1].content


def test_bind_tools_round_trip_and_streamed_calls(chat: Any) -> None:
    llm = chat(max_tokens=40)
    ask = [HumanMessage("What is the weather in Paris?")]
    calling = llm.bind_tools([get_weather], tool_choice="get_weather")
    asked = calling.invoke(ask)
    (call,) = asked.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}
    assert call["id"] and asked.response_metadata["finish_reason"] == "tool_calls"

    # streamed: the call's pieces add up to the same call
    chunks = list(calling.stream(ask))
    assert any(c.tool_call_chunks for c in chunks)
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]

    # the tool's result goes back as a ToolMessage; the model answers in words
    result = get_weather.invoke(call)
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    final = chat().bind_tools([get_weather], tool_choice="none").invoke([*ask, asked, result])
    assert isinstance(final.content, str) and final.content and not final.tool_calls
    # the conversation so far was the previous prompt: its tokens came from the cache
    assert final.usage_metadata["input_token_details"]["cache_read"] > 0


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output(chat: Any, method: str) -> None:
    llm = chat(max_tokens=48).with_structured_output(Capital, method=method)
    answer = llm.invoke([HumanMessage("What is the capital of France?")])
    assert isinstance(answer, Capital) and answer.country and answer.capital


def test_json_mode(chat: Any) -> None:
    llm = chat(max_tokens=32).with_structured_output(None, method="json_mode")
    answer = llm.invoke(
        [SystemMessage("Answer in JSON."), HumanMessage("Give the capital of France as JSON.")]
    )
    assert isinstance(answer, dict) and answer


def test_logprobs_and_cached_turns(chat: Any) -> None:
    llm = chat(logprobs=True, top_logprobs=2, max_tokens=6)
    first = llm.invoke(ASK)
    tokens = first.response_metadata["logprobs"]["content"]
    assert len(tokens) == first.usage_metadata["output_tokens"]
    assert all(t["logprob"] <= 0 and len(t["top_logprobs"]) == 2 for t in tokens)
    assert "".join(t["token"] for t in tokens) == first.content
    # the next turn's prompt starts with this one's: the gateway reports the cached tokens
    second = llm.invoke([*ASK, first, HumanMessage("And at night?")])
    details = second.usage_metadata["input_token_details"]
    assert details["cache_read"] >= first.usage_metadata["input_tokens"] - 1


def test_responses_api_mode(chat: Any, photo_url: str) -> None:
    llm = chat(use_responses_api=True, max_tokens=12)
    answer = llm.invoke(ASK)
    assert answer.text and answer.response_metadata["status"] in ("completed", "incomplete")
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] > 0
    look = HumanMessage(
        content=[
            {"type": "text", "text": "Describe the photo."},
            {"type": "image_url", "image_url": {"url": photo_url}},
        ]
    )
    chunks = list(llm.stream([look]))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    assert streamed.text
