"""The `openai` engine in front of a real vLLM: the CPU build from PyPI, in its own venv
(`make vllm-env`), serving a small random-weight Qwen2.5-VL checkpoint built with transformers'
own classes (the test fixture's shapes with 32-wide attention heads: vLLM's CPU attention takes
no narrower ones).

One pair of vLLM servers serves the whole module (a start costs a minute or two on two cores):
"primary" for every test, and "spare" beside it for failover, which runs last because it kills
a replica. Each test starts its gateways in-process on loopback ports, with the official
`openai` client in front. Greedy answers are compared token for token with what the same vLLM
answers a client that talks to it directly.

The replicas run with `--block-size 32` (the CPU backend's default is 128, and vLLM's prefix
cache reuses whole blocks only), `--enable-prompt-tokens-details` (for `cached_tokens`),
`--enable-mm-embeds` (embeds mode) and the llguidance structured-output backend (the grammars
the gateway plans for tools and response formats are llguidance's Lark).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from gateway.server.app import create_app
from gateway.server.runner import ServerThread
from gateway.settings import Settings
from gateway.testing.images import data_url, photo_bytes
from gateway.testing.ports import free_port
from gateway.testing.vllm_server import VllmServer, add_video_processor_config, vllm_missing

pytestmark = [
    pytest.mark.slow,
    # the first test also waits for both servers to start: minutes on a busy 2-core machine
    pytest.mark.timeout(1200),
    pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or ""),
]

SERVED = "org/tiny-qwen2.5-vl"  # the name the replicas serve it under (a hub-style name)
PHOTO = photo_bytes("chelsea", "PNG", 96)
QUESTION = "What is in the photo?"
MAX_TOKENS = 12
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
        },
    },
}


def vllm_checkpoint(target: Path) -> Path:
    """The tiny Qwen2.5-VL fixture as vLLM can serve it: text heads 32 wide (2 heads, 1 KV
    head, M-RoPE sections summing to 16), and the video processor's config that vLLM loads
    with the processor (a published checkpoint's preprocessor_config.json stands for both)."""
    from tests.vlm_checkpoints import qwen2_5_vl

    path = qwen2_5_vl.build(
        target,
        text={
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [4, 6, 6],
            },
        },
    )
    return add_video_processor_config(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vllm_checkpoint(tmp_path_factory.mktemp("qwen") / "tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def replicas(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmServer, VllmServer]]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = tuple(
        VllmServer(
            checkpoint,
            name=name,
            served_model_name=SERVED,
            mm_embeds=True,
            structured_backend="guidance",
            max_model_len=4096,
            log_dir=logs,
        )
        for name in ("primary", "spare")
    )
    try:
        for server in servers:  # both load at once
            server.start()
        for server in servers:
            server.wait_ready()
        yield servers  # type: ignore[misc]
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def primary(replicas: tuple[VllmServer, VllmServer]) -> VllmServer:
    return replicas[0]


@contextlib.contextmanager
def gateway(*upstreams: VllmServer, **options: object) -> Iterator[openai.OpenAI]:
    """A gateway (`--engine openai`) in front of `upstreams`, and an OpenAI client for it."""
    settings = Settings(
        engine="openai",
        upstreams=[u.url for u in upstreams],
        device="cpu",
        port=free_port(),
        **options,
    )
    with ServerThread(create_app(settings), settings, port=settings.port) as server:
        server.wait_ready(timeout=180)
        yield openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)


def direct(server: VllmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def photo_turn(text: str = QUESTION) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(PHOTO, "image/png")}},
                {"type": "text", "text": text},
            ],
        }
    ]


def photo_input(text: str = QUESTION) -> list[dict]:
    """`photo_turn` as a Responses input."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "input_image", "image_url": data_url(PHOTO, "image/png")},
                {"type": "input_text", "text": text},
            ],
        }
    ]


def greedy(client: openai.OpenAI, messages: list[dict], model: str = SERVED, **extra: object):
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, **extra
    )


def served_requests(server: VllmServer) -> float:
    """Requests the server finished so far (its Prometheus counter, every finish reason)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


# ------------------------------------------------------------------------------ answers


def test_data_url_mode_answers_what_vllm_answers(primary: VllmServer) -> None:
    alone = greedy(direct(primary), photo_turn())
    with gateway(primary) as client:
        through = greedy(client, photo_turn())
    assert alone.choices[0].message.content  # random weights, but some text
    assert through.choices[0].message.content == alone.choices[0].message.content
    assert through.usage.prompt_tokens == alone.usage.prompt_tokens
    assert through.usage.completion_tokens == alone.usage.completion_tokens
    # the image's placeholder tokens, as vLLM counts them
    images = alone.usage.prompt_tokens_details.multimodal_tokens["image"]
    assert images > 0
    assert through.usage.prompt_tokens_details.image_tokens == images


def test_embeds_mode_answers_with_the_same_prompt(primary: VllmServer, checkpoint: Path) -> None:
    """The gateway encodes with the checkpoint's own vision tower (exact mode: every token,
    float32) and sends `image_embeds` with the image's grid; the replica runs no vision tower
    and answers as it does for the photo itself."""
    alone = greedy(direct(primary), photo_turn())
    with gateway(
        primary,
        upstream_images="embeds",
        model_path=str(checkpoint),
        pruning="none",
        visual_tokens="fp32",
    ) as client:
        first = greedy(client, photo_turn())
        again = greedy(client, photo_turn("Describe it in one word."))
    assert first.usage.prompt_tokens == alone.usage.prompt_tokens
    assert first.choices[0].message.content == alone.choices[0].message.content
    assert again.choices[0].message.content and again.usage.prompt_tokens > 0


def test_a_sessions_follow_up_reuses_the_replicas_prefix_cache(primary: VllmServer) -> None:
    """A follow-up in a Responses chain (the gateway re-sends the conversation on the replica
    that served it) finds at least as many prompt tokens in vLLM's prefix cache as a client
    that re-sends its history to vLLM directly."""
    system = "You answer questions about photos. " * 8  # past one 32-token block
    follow_up = "And what colours are in it?"
    vllm = direct(primary)
    history = [{"role": "system", "content": system}, *photo_turn()]
    first = greedy(vllm, history)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": follow_up},
    ]
    alone = greedy(vllm, history)
    with gateway(primary) as client:
        turn = client.responses.create(
            model=SERVED,
            instructions=system,
            input=photo_input(),
            max_output_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert turn.output_text == first.choices[0].message.content
        second = client.responses.create(
            model=SERVED,
            previous_response_id=turn.id,
            instructions=system,
            input=follow_up,
            max_output_tokens=MAX_TOKENS,
            temperature=0,
        )
    direct_cached = alone.usage.prompt_tokens_details.cached_tokens
    assert direct_cached >= 32  # whole 32-token blocks of the first turn
    assert second.usage.input_tokens == alone.usage.prompt_tokens
    assert second.usage.input_tokens_details.cached_tokens >= direct_cached
    assert second.output_text == alone.choices[0].message.content


def test_a_photo_sent_ahead_warms_the_replicas_prefix_cache(
    primary: VllmServer, checkpoint: Path
) -> None:
    """Embeds mode, a photo uploaded into a session before its question (`POST /v1/images`
    with the session): the gateway encodes it and prefills the conversation through the photo
    on the replica the question will go to. The question then finds the prompt through the
    photo in vLLM's prefix cache; a photo sent cold with its question finds less."""
    # large enough that the prompt through the photo spans a whole 32-token block
    ahead, cold = photo_bytes("astronaut", "PNG", 224), photo_bytes("coffee", "PNG", 224)
    embeds = dict(
        upstream_images="embeds", model_path=str(checkpoint), pruning="none", visual_tokens="fp32"
    )
    with gateway(primary, **embeds) as client:
        url = str(client.base_url).rstrip("/")
        before = served_requests(primary)
        uploaded = httpx.post(
            f"{url}/images",
            content=ahead,
            headers={"content-type": "image/png", "x-session-id": "warm-ahead"},
            timeout=60,
        )
        assert uploaded.status_code == 200, uploaded.text
        ref = uploaded.json()["ref"]
        deadline = time.monotonic() + 120
        while served_requests(primary) < before + 1:  # the one-token warm-up request
            assert time.monotonic() < deadline, "no warm-up reached the replica"
            time.sleep(0.1)
        warmed = ask_about(client, ref, "warm-ahead")
        unwarmed = ask_about(client, data_url(cold, "image/png"), "cold")
    images = warmed.usage.prompt_tokens_details.image_tokens
    assert images > 0 and warmed.usage.prompt_tokens == unwarmed.usage.prompt_tokens
    warm_cached = warmed.usage.prompt_tokens_details.cached_tokens
    cold_cached = unwarmed.usage.prompt_tokens_details.cached_tokens
    # the whole 32-token blocks through the photo were cached by the warm-up
    assert warm_cached >= 32 and warm_cached > cold_cached


def ask_about(client: openai.OpenAI, image_url: str, session: str):
    return client.chat.completions.create(
        model=SERVED,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_url}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        max_tokens=4,
        temperature=0,
        extra_body={"session_id": session},
    )


# ---------------------------------------------------------------- what is forwarded


def test_response_formats_round_trip(primary: VllmServer) -> None:
    """The gateway's grammar reaches the replica: a random-weight model writes JSON that
    validates against the schema, and the Responses API's text.format does the same."""
    ask = [{"role": "user", "content": "Describe a person."}]
    with gateway(primary) as client:
        schema = client.chat.completions.create(
            model=SERVED,
            messages=ask,
            max_tokens=60,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
        )
        anything = client.chat.completions.create(
            model=SERVED, messages=ask, max_tokens=60, response_format={"type": "json_object"}
        )
        response = client.responses.create(
            model=SERVED,
            input="Describe a person.",
            max_output_tokens=60,
            text={
                "format": {
                    "type": "json_schema",
                    "name": "person",
                    "schema": PERSON,
                    "strict": True,
                }
            },
        )
    jsonschema.validate(json.loads(schema.choices[0].message.content), PERSON)
    assert schema.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    jsonschema.validate(json.loads(response.output_text), PERSON)


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto", "none"],
    ids=["required", "named", "auto", "none"],
)
def test_tools_round_trip(primary: VllmServer, choice: object) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    with gateway(primary) as client:
        done = client.chat.completions.create(
            model=SERVED, messages=ask, max_tokens=60, tools=[WEATHER], tool_choice=choice
        )
    message = done.choices[0].message
    if choice == "none":
        assert not message.tool_calls and message.content is not None
        assert "<tool_call>" not in message.content
        return
    if choice != "auto":
        assert done.choices[0].finish_reason == "tool_calls"
    for call in message.tool_calls or ():
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert message.tool_calls or message.content


def test_logprobs_n_seed_and_stop_round_trip(primary: VllmServer) -> None:
    ask = [{"role": "user", "content": "Say something."}]
    with gateway(primary) as client:
        scored = greedy(client, ask, logprobs=True, top_logprobs=2)
        sampled = [
            client.chat.completions.create(
                model=SERVED, messages=ask, max_tokens=8, temperature=1.0, n=2, seed=7
            )
            for _ in range(2)
        ]
        text = scored.choices[0].message.content
        stop = text[len(text) // 2 :].strip()[:3]
        stopped = greedy(client, ask, stop=[stop])
    alone = greedy(direct(primary), ask, logprobs=True, top_logprobs=2)
    tokens = scored.choices[0].logprobs.content
    assert len(tokens) == scored.usage.completion_tokens
    assert "".join(t.token for t in tokens) == text
    for mine, theirs in zip(tokens, alone.choices[0].logprobs.content, strict=True):
        assert mine.token == theirs.token
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert len(mine.top_logprobs) == 2
        assert mine.top_logprobs[0].logprob >= mine.top_logprobs[1].logprob
    # n choices, and a seed makes them again
    assert [len(s.choices) for s in sampled] == [2, 2]
    assert [c.message.content for c in sampled[0].choices] == [
        c.message.content for c in sampled[1].choices
    ]
    # a stop string ends the answer before it
    assert stop and stop not in stopped.choices[0].message.content
    assert text.startswith(stopped.choices[0].message.content)


# ------------------------------------------------------------------------- failover (last)


def test_a_replica_killed_mid_conversation_loses_nothing(
    replicas: tuple[VllmServer, VllmServer],
) -> None:
    """A Responses chain on two replicas: the one that served the first turn is killed (the
    whole process group, as a crashed host); the next turn goes to the other, whose answer is
    the one it gives the whole conversation directly: the stored history lost nothing."""
    follow_up = "What else?"
    with gateway(*replicas) as client:
        before = [served_requests(r) for r in replicas]
        turn = client.responses.create(
            model=SERVED,
            input=photo_input(),
            max_output_tokens=MAX_TOKENS,
            temperature=0,
        )
        after = [served_requests(r) for r in replicas]
        (served,) = [i for i in range(2) if after[i] > before[i]]
        replicas[served].kill()
        survivor = replicas[1 - served]
        second = client.responses.create(
            model=SERVED,
            previous_response_id=turn.id,
            input=follow_up,
            max_output_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert served_requests(survivor) > after[1 - served]
    history = [
        *photo_turn(),
        {"role": "assistant", "content": turn.output_text},
        {"role": "user", "content": follow_up},
    ]
    alone = greedy(direct(survivor), history)
    assert second.error is None and second.status in ("completed", "incomplete")  # or max tokens
    assert second.output_text == alone.choices[0].message.content
    assert second.usage.input_tokens == alone.usage.prompt_tokens
