"""A Realtime tool round trip with an image in the conversation, through the official `openai`
SDK's realtime client, against the real model: greedy, it answers token for token what the same
turns answer over Chat Completions on the same gateway (the call, then the text after the
tool's result), with the same prompt and answer token counts."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from openai import AsyncOpenAI

from gateway.testing.realtime_peer import data_url
from tests.conftest import photo_bytes

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
INSTRUCTIONS = (
    "You are a weather assistant. Call get_weather to look the weather up; once its result is "
    "back, tell the user about it in one plain sentence."
)
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
DESCRIPTION = "Get the current weather in the city of the photo."
RESULT = "Sunny and 21 degrees."
QUESTION = "Where is this? What is the weather like there right now?"
CALL_TOKENS, ANSWER_TOKENS = 40, 24


async def until(conn: Any, kind: str) -> tuple[Any, list[Any]]:
    seen = []
    while True:
        event = await asyncio.wait_for(conn.recv(), 120)
        assert event.type != "error", event.error
        if event.type == kind:
            return event, seen
        seen.append(event)


async def test_realtime_tool_round_trip_with_an_image_matches_chat_completions(
    gateway_server,
) -> None:
    photo = data_url(photo_bytes("astronaut", size=320))  # one photo: a reproducible answer
    client = AsyncOpenAI(base_url=f"{gateway_server.http_url}/v1", api_key="unused")
    try:
        async with client.realtime.connect(model=MODEL) as conn:
            await conn.session.update(
                session={
                    "type": "realtime",
                    "instructions": INSTRUCTIONS,
                    "tools": [
                        {
                            "type": "function",
                            "name": "get_weather",
                            "description": DESCRIPTION,
                            "parameters": PARAMETERS,
                        }
                    ],
                    "tool_choice": "required",
                    "parallel_tool_calls": False,
                }
            )
            await until(conn, "session.updated")
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": photo},
                        {"type": "input_text", "text": QUESTION},
                    ],
                }
            )
            await until(conn, "conversation.item.done")
            await conn.response.create(response={"max_output_tokens": CALL_TOKENS})
            called, events = await until(conn, "response.done")
            [call] = called.response.output
            assert call.type == "function_call" and call.name == "get_weather"
            streamed = "".join(e.delta for e in events if e.type.endswith("arguments.delta"))
            assert streamed == call.arguments
            assert set(json.loads(call.arguments)) == {"city"}

            await conn.conversation.item.create(
                item={"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
            )
            await until(conn, "conversation.item.done")
            await conn.response.create(
                response={"tool_choice": "none", "max_output_tokens": ANSWER_TOKENS}
            )
            answered, events = await until(conn, "response.done")
            [message] = answered.response.output
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert message.type == "message" and text == message.content[0].text and text

        # the same two turns over Chat Completions
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": DESCRIPTION,
                    "parameters": PARAMETERS,
                },
            }
        ]
        asked = [
            {"role": "system", "content": INSTRUCTIONS},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": photo}},
                    {"type": "text", "text": QUESTION},
                ],
            },
        ]
        first = await client.chat.completions.create(
            model=MODEL,
            messages=asked,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=CALL_TOKENS,
            temperature=0,
        )
        [chat_call] = first.choices[0].message.tool_calls
        assert (chat_call.function.name, chat_call.function.arguments) == (
            call.name,
            call.arguments,
        )
        usage = called.response.usage
        assert first.usage.completion_tokens == usage.output_tokens
        assert first.usage.prompt_tokens == usage.input_tokens
        assert (
            first.usage.prompt_tokens_details.image_tokens
            == usage.input_token_details.image_tokens
            > 0
        )

        final = await client.chat.completions.create(
            model=MODEL,
            messages=[
                *asked,
                first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": chat_call.id, "content": RESULT},
            ],
            tools=tools,
            tool_choice="none",
            parallel_tool_calls=False,
            max_tokens=ANSWER_TOKENS,
            temperature=0,
        )
        assert final.choices[0].message.content == text
        usage = answered.response.usage
        assert final.usage.completion_tokens == usage.output_tokens
        assert final.usage.prompt_tokens == usage.input_tokens
    finally:
        await client.close()
