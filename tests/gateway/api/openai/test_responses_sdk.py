"""The Responses API and legacy completions with the official `openai` client against the real
gateway (SmolLM2 and the real encoder): a chain of responses reuses the vision and KV caches of
its session, a stream gives the plain answer, stored responses can be retrieved, forked and
deleted."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from gateway.testing.images import data_url

TOKENS = 8


@pytest.fixture(scope="module")
def chain(openai_client: OpenAI, model: str, astronaut_jpeg: bytes) -> list:
    """Three responses chained through previous_response_id, the first with a real photo."""
    first = openai_client.responses.create(
        model=model,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(astronaut_jpeg)},
                    {"type": "input_text", "text": "What is in the picture?"},
                ],
            }
        ],
        max_output_tokens=TOKENS,
        temperature=0,
    )
    second = openai_client.responses.create(
        model=model,
        input="What colours do you see?",
        previous_response_id=first.id,
        max_output_tokens=TOKENS,
        temperature=0,
    )
    third = openai_client.responses.create(
        model=model,
        input="Say it in one word.",
        previous_response_id=second.id,
        max_output_tokens=TOKENS,
        temperature=0,
    )
    return [first, second, third]


def test_a_response_about_a_photo(chain: list, model: str) -> None:
    first = chain[0]
    assert first.id.startswith("resp_") and first.model == model
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.output[0].type == "message" and first.output[0].role == "assistant"
    usage = first.usage
    assert usage is not None and 1 <= usage.output_tokens <= TOKENS
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    ext = first.model_extra["visiongate"]
    assert (
        ext["image_tokens"] > 0 and ext["cache"]["vision_hits"] + ext["cache"]["vision_misses"] == 1
    )
    assert ext["session_id"].startswith("sess_")


def test_a_chain_reuses_its_session_caches(chain: list) -> None:
    first, second, third = chain
    session_id = first.model_extra["visiongate"]["session_id"]
    for later, earlier in ((second, first), (third, second)):
        ext = later.model_extra["visiongate"]
        assert ext["session_id"] == session_id and not ext.get("forked")
        assert ext["cache"]["vision"] == "hit" and ext["timings"]["encode_ms"] == 0.0
        cached = later.usage.input_tokens_details.cached_tokens
        assert cached > 0 and cached == ext["cache"]["kv_tokens_reused"]
        assert later.usage.input_tokens > earlier.usage.input_tokens
        assert later.previous_response_id == earlier.id


def test_a_fork_continues_the_same_response_twice(
    openai_client: OpenAI, model: str, chain: list
) -> None:
    first, second, _ = chain
    fork = openai_client.responses.create(
        model=model,
        input="What colours do you see?",
        previous_response_id=first.id,
        max_output_tokens=TOKENS,
        temperature=0,
    )
    ext = fork.model_extra["visiongate"]
    assert ext["forked"] is True
    assert ext["session_id"] != first.model_extra["visiongate"]["session_id"]
    # the same conversation as the second response: the same greedy answer
    assert fork.output_text == second.output_text
    assert ext["cache"]["vision"] == "hit"


def test_stream_ends_with_the_plain_answer(openai_client: OpenAI, model: str) -> None:
    ask = dict(model=model, input="Name three fruits.", max_output_tokens=TOKENS, temperature=0)
    plain = openai_client.responses.create(**ask)
    events = list(openai_client.responses.create(**ask, stream=True))
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
        "response.completed" if plain.status == "completed" else "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2
    done = events[-1].response
    assert "".join(deltas) == done.output_text == plain.output_text
    assert done.usage.output_tokens == plain.usage.output_tokens


def test_retrieve_and_delete(openai_client: OpenAI, chain: list) -> None:
    third = chain[2]
    got = openai_client.responses.retrieve(third.id)
    assert got.id == third.id and got.output_text == third.output_text
    openai_client.responses.delete(third.id)
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.responses.retrieve(third.id)
    assert info.value.body["code"] == "response_not_found"


def test_unknown_previous_response(openai_client: OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.responses.create(
            model=model, input="hello", previous_response_id="resp_0000000000000000"
        )
    assert info.value.body["param"] == "previous_response_id"


def test_completions(openai_client: OpenAI, model: str) -> None:
    one = openai_client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0, n=1
    )
    assert one.object == "text_completion" and len(one.choices) == 1
    assert one.choices[0].text and one.choices[0].finish_reason in ("stop", "length")
    assert one.usage.prompt_tokens > 0 and 1 <= one.usage.completion_tokens <= 4

    two = openai_client.completions.create(
        model=model, prompt=["The capital of France is", "One, two,"], max_tokens=4, temperature=0
    )
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == one.choices[0].text  # greedy: the same answer again

    chunks = list(
        openai_client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=4, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == one.choices[0].text
    assert chunks[-1].choices[0].finish_reason == one.choices[0].finish_reason
