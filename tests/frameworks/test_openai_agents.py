"""The OpenAI Agents SDK (`openai-agents`) against the real gateway over TLS: an agent with a
function tool, on the SDK's Chat Completions model and on its Responses model, run and
streamed. The first turn must call the tool (`tool_choice` "required"); the tool is then
disabled for the run (the embedded 135M model, left the choice, calls it again and again), so
the next turn answers in words from the tool's result, which the gateway reads back from the
conversation's history (plain text: with no tools offered and results in the history, the
grammar keeps the model from echoing the results' `<tool_response>` markup, as it did)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunContextWrapper,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.items import ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI

from tests.frameworks.conftest import API_KEY

pytestmark = pytest.mark.slow


def not_called_yet(ctx: RunContextWrapper[dict], agent: Agent) -> bool:
    return not ctx.context["calls"]


@function_tool(is_enabled=not_called_yet)
def get_weather(ctx: RunContextWrapper[dict], city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: the city's name
    """
    ctx.context["calls"].append(city)
    return f"It is sunny and 21 C in {city}."


@pytest.fixture(scope="module", autouse=True)
def no_tracing() -> Iterator[None]:
    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    yield
    set_tracing_disabled(False)


@pytest.fixture(scope="module")
def client(base_url: str, test_ca: Any) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=base_url,
        api_key=API_KEY,
        max_retries=0,
        http_client=httpx.AsyncClient(verify=test_ca.context(), timeout=300),
    )


def agent(model: Any) -> Agent:
    return Agent(
        name="weather",
        instructions="Use the tools, then answer in one short sentence.",
        tools=[get_weather],
        model=model,
        model_settings=ModelSettings(tool_choice="required", max_tokens=48),
    )


def models(client: AsyncOpenAI, model_id: str) -> dict[str, Any]:
    return {
        "chat": OpenAIChatCompletionsModel(model=model_id, openai_client=client),
        "responses": OpenAIResponsesModel(model=model_id, openai_client=client),
    }


def check_run(items: list[Any], final: object, context: dict) -> None:
    calls = [i for i in items if isinstance(i, ToolCallItem)]
    outputs = [i for i in items if isinstance(i, ToolCallOutputItem)]
    assert len(calls) == len(outputs) == len(context["calls"]) >= 1
    assert all(o.output.startswith("It is sunny") for o in outputs)
    assert all(isinstance(city, str) and city for city in context["calls"])
    # words, not an imitation of how the prompt wraps the tool's result
    assert isinstance(final, str) and final.strip() and not final.startswith("<")


@pytest.mark.parametrize("kind", ["chat", "responses"])
async def test_agent_runs_and_streams_a_tool(client: AsyncOpenAI, model_id: str, kind: str) -> None:
    question = "What is the weather in Paris?"
    ran: dict = {"calls": []}
    result = await Runner.run(
        agent(models(client, model_id)[kind]), question, context=ran, max_turns=3
    )
    check_run(result.new_items, result.final_output, ran)

    streamed: dict = {"calls": []}
    run = Runner.run_streamed(
        agent(models(client, model_id)[kind]), question, context=streamed, max_turns=3
    )
    kinds, text = [], []
    async for event in run.stream_events():
        kinds.append(event.type)
        if event.type == "raw_response_event" and event.data.type == "response.output_text.delta":
            text.append(event.data.delta)
    assert "run_item_stream_event" in kinds and "raw_response_event" in kinds
    check_run(run.new_items, run.final_output, streamed)
    assert "".join(text) == run.final_output  # the answer streamed as it came
    # greedy: streamed, the same call and the same answer
    assert streamed["calls"] == ran["calls"] and run.final_output == result.final_output
