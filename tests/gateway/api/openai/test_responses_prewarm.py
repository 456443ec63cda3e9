"""`/v1/responses` over WebSocket and `prompt_cache_options.prewarm` on the real gateway (SmolLM2
and the real encoder), with the official SDK: the socket's greedy answers are the HTTP route's,
and a photo prewarmed, then asked about with `previous_response_id`, gets the answer the same
conversation gets in one request without prewarm, token for token, from a prompt whose warmed
prefix was reused rather than prefilled again."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from openai import OpenAI

from gateway.server.runner import ServerThread
from gateway.testing.images import data_url, unique_photo

pytestmark = pytest.mark.slow

TOKENS = 10
ANSWERED = ("completed", "incomplete")  # incomplete: TOKENS were written
ENDS = ("response.completed", "response.incomplete", "response.failed", "error")


def photo_item(data: bytes, text: str | None = None) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "input_image", "image_url": data_url(data)}]
    if text is not None:
        content.append({"type": "input_text", "text": text})
    return {"role": "user", "content": content}


def test_socket_answers_are_the_http_routes(
    openai_client: OpenAI, gateway_server: ServerThread, model: str
) -> None:
    photo = unique_photo("coffee")
    ask = {"model": model, "max_output_tokens": TOKENS, "temperature": 0}
    first = openai_client.responses.create(
        input=[photo_item(photo, "What is in this photo?")], **ask
    )
    second = openai_client.responses.create(
        input="What colours stand out?", previous_response_id=first.id, **ask
    )

    async def over_socket() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{gateway_server.http_url}/v1", api_key="unused", max_retries=0
        ) as client:
            texts: list[str] = []
            async with client.responses.connect() as connection:
                previous = None
                for turn in (
                    [photo_item(photo, "What is in this photo?")],
                    "What colours stand out?",
                ):
                    await connection.response.create(
                        input=turn, previous_response_id=previous, **ask
                    )
                    async for event in connection:
                        if event.type in ENDS:
                            break
                    assert event.response.status in ANSWERED, event
                    texts.append(event.response.output_text)
                    previous = event.response.id
            return texts

    assert asyncio.run(over_socket()) == [first.output_text, second.output_text]


def test_a_prewarmed_photo_gets_the_same_answer_from_its_warmed_prefix(
    openai_client: OpenAI, model: str
) -> None:
    photo = unique_photo("rocket")
    ask = {"model": model, "max_output_tokens": TOKENS, "temperature": 0}
    warmed = openai_client.responses.create(
        model=model, input=[photo_item(photo)], prompt_cache_options={"prewarm": True}
    )
    assert warmed.status == "completed" and warmed.output == []
    written = warmed.usage.input_tokens_details.cache_write_tokens
    assert warmed.usage.output_tokens == 0 and written > 0
    assert warmed.visiongate["cache"]["vision"] == "miss"  # encoded by the prewarm

    with openai_client.responses.connect() as connection:
        connection.response.create(
            input="What is in this photo?", previous_response_id=warmed.id, **ask
        )
        for event in connection:
            if event.type in ENDS:
                break
    assert event.response.status in ANSWERED, event
    asked = event.response
    # the warmed prefix was reused, not prefilled again; the photo's tokens came from the cache
    assert asked.usage.input_tokens_details.cached_tokens >= written // 2
    assert asked.visiongate["cache"]["vision"] == "hit"

    # the same conversation in one request, without prewarm: the same answer, token for token
    plain = openai_client.responses.create(
        input=[photo_item(photo), {"role": "user", "content": "What is in this photo?"}],
        store=False,
        **ask,
    )
    assert asked.output_text == plain.output_text
    assert asked.usage.output_tokens == plain.usage.output_tokens
    assert asked.usage.input_tokens == plain.usage.input_tokens
