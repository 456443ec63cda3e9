"""The Python SDK's `.parse()` on the real model, with the SDK's own structured-output example
(a math tutor's steps): nothing in its schema is bounded, and the embedded 135M model, left
alone, loops inside a string until `max_tokens` (`LengthFinishReasonError`). The grammar's
bounds, sized to the answer's budget, make it close."""

from __future__ import annotations

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.frameworks.conftest import API_KEY, LocalCA

pytestmark = pytest.mark.slow


class Step(BaseModel):
    explanation: str
    output: str


class MathResponse(BaseModel):
    steps: list[Step]
    final_answer: str


TUTOR = [
    {"role": "system", "content": "You are a helpful math tutor."},
    {"role": "user", "content": "solve 8x + 31 = 2"},
]


@pytest.fixture(scope="module")
def client(base_url: str, test_ca: LocalCA) -> openai.OpenAI:
    http = httpx.Client(verify=test_ca.context(), timeout=300)
    return openai.OpenAI(base_url=base_url, api_key=API_KEY, http_client=http, max_retries=0)


@pytest.mark.parametrize("max_tokens", [40, 96])
def test_chat_parse_closes_within_max_tokens(
    client: openai.OpenAI, model_id: str, max_tokens: int
) -> None:
    completion = client.chat.completions.parse(
        model=model_id, messages=TUTOR, response_format=MathResponse, max_tokens=max_tokens
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and completion.usage.completion_tokens <= max_tokens
    assert isinstance(choice.message.parsed, MathResponse)


def test_responses_parse_closes(client: openai.OpenAI, model_id: str) -> None:
    response = client.responses.parse(
        model=model_id, input=TUTOR, text_format=MathResponse, max_output_tokens=64
    )
    assert response.status == "completed"
    assert isinstance(response.output_parsed, MathResponse)
