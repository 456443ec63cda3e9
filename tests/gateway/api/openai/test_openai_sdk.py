"""The official `openai` SDK's own helpers against the real gateway and model: the stream
helper, `.parse()` with a Pydantic model, tool calls there and back, structured outputs,
logprobs, several choices and the context limit. Answers are kept a few tokens long."""

from __future__ import annotations

import json
import math
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import openai
import pydantic
import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
ASK_WEATHER = {"role": "user", "content": "What is the weather like in Paris right now?"}
WEATHER_INSTRUCTIONS = (
    "You are a weather assistant. Call get_weather to look the weather up; once its result is "
    "back, tell the user about it in one plain sentence."
)


class Colour(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    colour: Literal["red", "green", "blue", "yellow"]
    bright: bool


def test_stream_helper_yields_content_and_the_final_completion(
    openai_client: OpenAI, model: str
) -> None:
    with openai_client.chat.completions.stream(
        model=model,
        messages=[{"role": "user", "content": "Say hello in one short sentence."}],
        max_tokens=32,
        stop=["\n", "."],
        temperature=0,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(deltas).strip() and len(deltas) >= 2
    choice = final.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == "".join(deltas)
    assert final.object == "chat.completion" and final.id.startswith("chatcmpl-")


def test_parse_gives_the_pydantic_object(openai_client: OpenAI, model: str) -> None:
    completion = openai_client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Name a colour of the sky and say if it is bright."}],
        response_format=Colour,
        max_tokens=32,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Colour)
    assert Colour.model_validate_json(choice.message.content) == choice.message.parsed


def test_structured_outputs_follow_the_schema_on_twenty_prompts(
    openai_client: OpenAI, model: str
) -> None:
    things = [
        "a banana", "grass", "the sea", "a fire truck", "the sun", "a lemon", "a frog",
        "blood", "the sky", "a tomato", "a leaf", "a canary", "a sapphire", "a cherry",
        "an emerald", "a lime", "a strawberry", "a blueberry", "corn", "a ruby",
    ]  # fmt: skip
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "colour", "schema": Colour.model_json_schema(), "strict": True},
    }

    def ask(thing: str) -> tuple[str | None, str | None]:
        completion = openai_client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"What colour is {thing}? Answer in JSON."}],
            response_format=response_format,
            max_tokens=32,
            temperature=0.7,
            seed=len(thing),
        )
        return completion.choices[0].message.content, completion.choices[0].finish_reason

    with ThreadPoolExecutor(max_workers=5) as pool:
        answers = list(pool.map(ask, things))
    for content, finish_reason in answers:
        assert finish_reason == "stop", content
        Colour.model_validate_json(content or "")  # raises if the schema is not followed


def test_a_tool_call_round_trip(openai_client: OpenAI, model: str) -> None:
    session = {"session_id": f"sdk-tools-{uuid.uuid4().hex[:8]}"}
    asked = [{"role": "system", "content": WEATHER_INSTRUCTIONS}, ASK_WEATHER]
    first = openai_client.chat.completions.create(
        model=model,
        messages=asked,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,  # one call (a small model repeats calls when it may)
        max_tokens=40,
        temperature=0,
        extra_body=session,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)

    history = [
        *asked,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny and 21 degrees in Paris."},
    ]

    def answer(tool_choice: str) -> openai.types.chat.ChatCompletion:
        return openai_client.chat.completions.create(
            model=model,
            messages=history,
            tools=[WEATHER],
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            max_tokens=24,
            temperature=0,
            extra_body=session,
        )

    # the same tools offered: the first request's prompt (instructions, tools, question) is
    # reused, not computed again
    again = answer("auto")
    assert again.usage.prompt_tokens > first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 2
    # no more calls: the model answers in text. The tools stay listed under "none" (the grammar
    # alone keeps it to text), so the whole first prompt is reused here too
    final = answer("none")
    text = final.choices[0]
    assert text.message.tool_calls is None and text.message.content
    assert text.finish_reason in ("stop", "length")
    assert final.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 2

    stored = openai_client.get(f"/sessions/{session['session_id']}", cast_to=object)
    assert [i["role"] for i in stored["items"]] == ["user", "assistant", "tool", "assistant"]


def test_streamed_tool_calls_assemble_like_the_whole_answer(
    openai_client: OpenAI, model: str
) -> None:
    request = dict(
        model=model,
        messages=[ASK_WEATHER],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
        temperature=0,
    )
    whole = openai_client.chat.completions.create(**request)
    with openai_client.chat.completions.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"
    streamed = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    # strict tool: the SDK parsed the arguments too
    assert streamed[0].function.parsed_arguments == json.loads(streamed[0].function.arguments)
    assert any(e.type == "tool_calls.function.arguments.delta" for e in events)


def test_logprobs_match_the_greedy_tokens(openai_client: OpenAI, model: str) -> None:
    completion = openai_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Count: one, two, three"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = completion.choices[0]
    tokens = choice.logprobs.content
    assert len(tokens) == completion.usage.completion_tokens
    assert "".join(t.token for t in tokens) == choice.message.content
    for t in tokens:
        assert len(t.top_logprobs) == 3
        assert t.logprob <= 0.0 and 0.0 < math.exp(t.logprob) <= 1.0
        # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0].token == t.token
        assert math.isclose(t.top_logprobs[0].logprob, t.logprob, abs_tol=1e-4)
        probabilities = [math.exp(top.logprob) for top in t.top_logprobs]
        assert probabilities == sorted(probabilities, reverse=True)
        assert sum(probabilities) <= 1.0 + 1e-4
        assert bytes(t.bytes) == t.token.encode()


def test_three_choices(openai_client: OpenAI, model: str) -> None:
    completion = openai_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a name for a cat."}],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        logprobs=True,
    )
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert all(c.message.content for c in completion.choices)
    per_choice = [len(c.logprobs.content) for c in completion.choices]
    assert completion.usage.completion_tokens == sum(per_choice) >= 3


def test_a_prompt_past_the_context_is_a_bad_request(openai_client: OpenAI, model: str) -> None:
    long = "hello " * 10_000  # about 10k tokens per message, past the model's 8k
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": long}, {"role": "user", "content": long}],
            max_tokens=4,
        )
    assert caught.value.status_code == 400 and caught.value.code == "context_length_exceeded"


def test_completions_take_token_id_prompts(
    openai_client: OpenAI, model: str, gateway_server
) -> None:
    """Token ids, as evaluation harnesses send them, answer what the same text does (greedy);
    an id outside the vocabulary is refused naming where it sits."""
    tokenizer = gateway_server.app.state["gateway"].engine.tokenizer
    text = "The capital of France is"
    ids = [int(i) for i in tokenizer(text)["input_ids"]]
    by_text = openai_client.completions.create(model=model, prompt=text, max_tokens=5)
    by_ids = openai_client.completions.create(model=model, prompt=ids, max_tokens=5)
    assert by_ids.choices[0].text == by_text.choices[0].text != ""
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    both = openai_client.completions.create(model="default", prompt=[ids, ids[:3]], max_tokens=2)
    assert [c.index for c in both.choices] == [0, 1] and both.model == model
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(model=model, prompt=[[5, len(tokenizer)]], max_tokens=2)
    assert info.value.body["param"] == "prompt[0][1]"
    assert f"0..{len(tokenizer) - 1}" in info.value.body["message"]
