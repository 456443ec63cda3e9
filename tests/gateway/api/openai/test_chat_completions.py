"""`POST /v1/chat/completions` with the official `openai` client against the real gateway."""

from __future__ import annotations

import time
import uuid

import httpx
import numpy as np
import openai
import pytest
from openai import OpenAI

from gateway.testing.images import data_url
from tests.conftest import photo_bytes


def image_message(image: bytes, question: str) -> dict:
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": question},
        ],
    }


def test_non_streaming_with_image(openai_client: OpenAI, model: str, camera_jpeg: bytes) -> None:
    completion = openai_client.chat.completions.create(
        model=model,
        messages=[image_message(camera_jpeg, "What is in the picture?")],
        max_tokens=8,
        temperature=0,
        seed=7,
    )
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    assert completion.model == model
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage is not None and usage.completion_tokens >= 1
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    ext = usage.model_extra["visiongate"]
    assert ext["image_tokens"] > 0 and ext["image_tokens_total"] >= ext["image_tokens"]
    assert ext["cache"]["vision_hits"] + ext["cache"]["vision_misses"] == 1
    assert set(ext["timings"]) >= {"encode_ms", "prefill_ms", "ttft_ms", "total_ms"}
    assert usage.prompt_tokens_details.image_tokens == ext["image_tokens"]
    assert completion.model_extra["visiongate"]["session_id"] is None  # no session: throwaway

    # the same image again, without a session: the content-addressed vision cache hits
    again = openai_client.chat.completions.create(
        model=model, messages=[image_message(camera_jpeg, "Describe the picture.")], max_tokens=4
    )
    cache = again.usage.model_extra["visiongate"]["cache"]
    assert cache["vision"] == "hit" and cache["vision_misses"] == 0
    assert again.usage.model_extra["visiongate"]["timings"]["encode_ms"] == 0.0


def test_streaming_with_image_and_usage(openai_client: OpenAI, model: str) -> None:
    image = photo_bytes("cat", size=224)
    stream = openai_client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You describe images."},
            image_message(image, "What animal is this?"),
        ],
        max_completion_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 2  # streamed piece by piece
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    assert finals[0].model_extra["visiongate"]["timings"]["ttft_ms"] > 0
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens >= 1
    assert usage_chunk.usage.model_extra["visiongate"]["image_tokens"] > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_without_usage_and_raw_sse(base_url: str, model: str) -> None:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Say hello."}],
    }
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert '"usage"' not in "".join(lines)  # not asked for
    assert '"finish_reason":"' in lines[-2]


def test_two_turn_session_shows_cache_hit_in_usage(openai_client: OpenAI, model: str) -> None:
    image = photo_bytes("rocket", size=200)
    session_id = f"http-test-{uuid.uuid4().hex[:8]}"
    messages = [image_message(image, "What is in the picture?")]
    first = openai_client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, extra_body={"session_id": session_id}
    )
    ext1 = first.usage.model_extra["visiongate"]
    assert ext1["session_id"] == session_id
    assert ext1["cache"]["vision"] == "miss"

    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "What colour is it?"},
    ]
    second = openai_client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, extra_headers={"X-Session-Id": session_id}
    )
    ext2 = second.usage.model_extra["visiongate"]
    assert ext2["cache"]["vision"] == "hit" and ext2["cache"]["vision_hits"] == 1
    assert ext2["timings"]["encode_ms"] == 0.0
    # the first turn's prompt (image included) is reused from the KV cache
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= ext1["image_tokens"] and cached == ext2["cache"]["kv_tokens_reused"]
    assert second.usage.prompt_tokens > first.usage.prompt_tokens

    # the session holds the conversation once, not twice
    stored = openai_client.get(f"/sessions/{session_id}", cast_to=object)
    assert [i["role"] for i in stored["items"]] == ["user", "assistant", "user", "assistant"]
    assert stored["items"][0]["content"][0]["image_url"]["url"].startswith("visiongate:sha256:")


def test_disconnect_mid_stream_frees_the_engine(
    base_url: str, model: str, openai_client: OpenAI
) -> None:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": 400,
        "messages": [{"role": "user", "content": "Count from one to one thousand in words."}],
    }
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # got text: hang up
    t0 = time.perf_counter()
    follow = openai_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    # 400 tokens at CPU speed would hold the engine for many seconds; cancelled, it waits for none
    assert follow.usage.model_extra["visiongate"]["timings"]["queue_ms"] < 3000
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize(
    "case",
    [
        "unknown_model",
        "no_messages",
        "malformed_data_url",
        "remote_url",
        "oversized_image",
        "n_9",
        "bad_role",
        "tool_choice_without_tools",
        "legacy_functions",
        "max_tokens_0",
    ],
)
def test_bad_requests_get_openai_errors(
    case: str, base_url: str, model: str, openai_client: OpenAI
) -> None:
    def image(url: str) -> list[dict]:
        return [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ]

    hello = [{"role": "user", "content": "hello"}]
    noise = np.random.default_rng(0).integers(0, 255, (1100, 1100, 3), dtype=np.uint8).tobytes()
    cases = {
        "unknown_model": (
            {"model": "gpt-nope", "messages": hello},
            404,
            "model_not_found",
            "model",
        ),
        "no_messages": ({"model": model, "messages": []}, 400, "invalid_request", "messages"),
        "malformed_data_url": (
            {"model": model, "messages": image("data:image/jpeg;base64,@@not-b64")},
            400,
            "invalid_image",
            "messages[0].content[0].image_url.url",
        ),
        "remote_url": (
            {"model": model, "messages": image("https://example.com/cat.jpg")},
            400,
            "invalid_image",
            "messages[0].content[0].image_url.url",
        ),
        "oversized_image": (
            {"model": model, "messages": image(data_url(noise[: 3 * 1024 * 1024]))},
            413,
            "image_too_large",
            "messages[0].content[0].image_url.url",
        ),
        "n_9": ({"model": model, "messages": hello, "n": 9}, 400, "invalid_request", "n"),
        "bad_role": (
            {"model": model, "messages": [{"role": "function", "content": "x"}]},
            400,
            "invalid_request",
            "messages[0].role",
        ),
        "tool_choice_without_tools": (
            {"model": model, "messages": hello, "tool_choice": "required"},
            400,
            "invalid_request",
            "tool_choice",
        ),
        "legacy_functions": (
            {"model": model, "messages": hello, "functions": [{"name": "f"}]},
            400,
            "invalid_request",
            "functions",
        ),
        "max_tokens_0": (
            {"model": model, "messages": hello, "max_tokens": 0},
            400,
            "invalid_request",
            "max_tokens",
        ),
    }
    kwargs, status, code, param = cases[case]
    with pytest.raises(openai.APIStatusError) as caught:
        openai_client.chat.completions.create(**kwargs)
    err = caught.value
    assert err.status_code == status
    assert err.code == code and err.param == param
    assert err.type == "invalid_request_error"
    # the raw body is exactly OpenAI's error object
    raw = httpx.post(f"{base_url}/v1/chat/completions", json=kwargs, timeout=60)
    assert raw.status_code == status
    assert set(raw.json()) == {"error"}
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}
    assert raw.json()["error"]["message"]
    if case == "remote_url":
        assert "remote" in raw.json()["error"]["message"]


def test_error_classes_of_the_openai_client(openai_client: OpenAI, model: str) -> None:
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(
            model="gpt-nope", messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model=model, messages=[])
