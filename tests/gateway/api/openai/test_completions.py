"""Legacy `/v1/completions` through the real app over the fake engine and encoder: one or many
prompts (texts or token ids), `n`, logprobs, echo, streaming, request checks, engine refusals and
a client that goes away mid-stream."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion

from gateway.testing.fake_gateway import FakeGateway, GatewayFactory, eventually
from gateway.testing.fakes import FakeEngine
from tests.gateway.api.openai.conftest import fake_http as http  # noqa: F401 - fixture
from tests.gateway.api.openai.conftest import fake_openai as client  # noqa: F401 - fixture
from tests.gateway.api.openai.conftest import sse

TIMEOUT = 10.0
MODEL = "fake-echo"


def test_completion_of_one_prompt(client: openai.OpenAI, fake_gateway: FakeGateway) -> None:
    completion = client.completions.create(model=MODEL, prompt="a b c", temperature=0.5, seed=3)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert [c.text for c in completion.choices] == ["a b c [0 images]"]
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    assert completion.usage.prompt_tokens == 3  # the engine's count of the prompt, as it is
    request = fake_gateway.engine.requests[-1]
    assert request.raw_prompt == "a b c" and request.messages == []
    assert request.cache_salt == "anonymous" and request.kv_key is None
    assert (request.sampling.temperature, request.sampling.seed) == (0.5, 3)


def test_completion_of_two_prompts_n2_with_logprobs(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": ["one two", "three"], "n": 2, "logprobs": 2}
    completion = Completion.model_validate(http.post("/v1/completions", json=body).json())
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert [c.text for c in completion.choices] == [
        "one two [0 images]",
        "one two [0 images] #1",
        "three [0 images]",
        "three [0 images] #1",
    ]
    for choice in completion.choices:
        lp = choice.logprobs
        assert lp is not None and "".join(lp.tokens) == choice.text
        assert lp.text_offset == [
            choice.text.index(t, o) for t, o in zip(lp.tokens, lp.text_offset, strict=True)
        ]
        tops = zip(lp.tokens, lp.top_logprobs, strict=True)
        assert all(t in top and len(top) <= 3 for t, top in tops)
        assert len(lp.token_logprobs) == len(lp.tokens)


def test_completion_defaults_and_echo(client: openai.OpenAI) -> None:
    long = " ".join(f"w{i}" for i in range(20))
    cut = client.completions.create(model=MODEL, prompt=long)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 16
    echoed = client.completions.create(model=MODEL, prompt="say hi", echo=True)
    assert echoed.choices[0].text == "say hi" + "say hi [0 images]"


def test_token_id_prompts(client: openai.OpenAI, fake_gateway: FakeGateway) -> None:
    """`prompt` as token ids (one list, or a list of lists, beside texts) reaches the engine as
    those ids (evaluation harnesses send them)."""
    one = client.completions.create(model=MODEL, prompt=[5, 6, 7])
    assert one.choices[0].text == "#5 #6 #7 [0 images]"
    assert fake_gateway.engine.requests[-1].raw_prompt == (5, 6, 7)
    many = client.completions.create(model=MODEL, prompt=[[1, 2], [3]], n=2)
    assert len(many.choices) == 4 and many.choices[2].text == "#3 [0 images]"
    assert [r.raw_prompt for r in fake_gateway.engine.requests[-2:]] == [(1, 2), (3,)]


def test_streamed_completion(http: httpx.Client, client: openai.OpenAI) -> None:
    body = {
        "model": MODEL,
        "prompt": ["x y", "z"],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    frames = [data for _, data in sse(http, "/v1/completions", body)]
    assert frames[-1] == "[DONE]"
    raw = [json.loads(f) for f in frames[:-1]]
    assert {c["object"] for c in raw} == {"text_completion"} and len({c["id"] for c in raw}) == 1
    by_choice: dict[int, str] = {}
    reasons = []
    for chunk in raw[:-1]:
        (choice,) = chunk["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
        by_choice[choice["index"]] = by_choice.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:  # null until the choice ends
            Completion.model_validate(chunk)
            reasons.append(choice["finish_reason"])
        assert "usage" not in chunk
    assert by_choice == {0: "x y [0 images]", 1: "z [0 images]"} and reasons == ["stop", "stop"]
    usage = Completion.model_validate(raw[-1])
    assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens == 5
    sdk = list(client.completions.create(model=MODEL, prompt="x y", stream=True))
    assert "".join(c.choices[0].text for c in sdk) == "x y [0 images]"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [1, -2, 3]}, "prompt[1]"),
        ({"prompt": [1, True]}, "prompt[1]"),
        ({"prompt": [1, 2.5]}, "prompt[1]"),
        ({"prompt": [[1, 2], [3, "x"]]}, "prompt[1][1]"),
        ({"prompt": [[1, 2], []]}, "prompt[1]"),
        ({"prompt": [[1], 7]}, "prompt[1]"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [3], "echo": True}, "echo"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "suffix": "end"}, "suffix"),
        ({"prompt": "x", "logprobs": 6}, "logprobs"),
        ({"prompt": "x", "logprobs": 1, "echo": True}, "echo"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
        ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "n": 9}, "n"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_bad_completion_requests(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    reply = http.post("/v1/completions", json={"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", param)


def test_completion_engine_refusal_is_its_http_error(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(engine=FakeEngine(busy=True))
    reply = httpx.post(
        f"{gateway.http_url}/v1/completions",
        json={"model": MODEL, "prompt": "x"},
        timeout=TIMEOUT,
    )
    assert reply.status_code == 429 and reply.json()["error"]["code"] == "busy"
    assert "retry-after" in reply.headers


def test_a_client_that_disconnects_cancels_every_prompt(make_gateway: GatewayFactory) -> None:
    engine = FakeEngine(delay_s=0.05)
    gateway = make_gateway(engine=engine)
    body = {"model": MODEL, "prompt": [" ".join(["w"] * 200)] * 2, "stream": True}
    with (
        httpx.Client(base_url=gateway.http_url, timeout=TIMEOUT) as http,
        http.stream("POST", "/v1/completions", json=body) as reply,
    ):
        for line in reply.iter_lines():
            if '"text":"w' in line:
                break
    asyncio.run(eventually(lambda: engine.running == 0))
    assert all(r.cancel.is_set() for r in engine.requests[-2:])
    assert [r.raw_prompt is not None for r in engine.requests[-2:]] == [True, True]
