"""`OpenAIEngine` against scripted OpenAI-compatible replicas on loopback ports
(gateway/testing/upstream_fake.py stands in for vLLM / SGLang): request bodies, streaming and usage,
failover, error mapping, cancellation, start-up checks, metrics and spans, and one request
through the whole gateway with the official `openai` client."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import re
import zipfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import openai
import pytest
import torch

from encoder_worker.types import ImageLayout
from gateway.engine.interface import (
    EngineBusy,
    EngineCapabilities,
    EngineError,
    GenerationRequest,
    GenerationResult,
    ImageInput,
    Message,
    SamplingParams,
    TextDelta,
)
from gateway.engine.upstream.endpoints import Upstream, parse_upstream
from gateway.engine.upstream.openai_engine import OpenAIEngine
from gateway.engine.upstream.routing import Replica, Router, route_key
from gateway.testing.engine_requests import drain as collect
from gateway.testing.upstream_fake import FakeUpstream, Script, wait_until
from tests.conftest import free_port, photo_bytes


@asynccontextmanager
async def started(*fakes: FakeUpstream | str, **options) -> AsyncIterator[OpenAIEngine]:
    upstreams = [parse_upstream(f if isinstance(f, str) else f.url) for f in fakes]
    engine = OpenAIEngine(upstreams, **options)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.aclose()


def request(
    text: str = "What is in the photo?",
    *,
    images: tuple[ImageInput, ...] = (),
    kv_key: str | None = "session-1",
    **sampling,
) -> GenerationRequest:
    return GenerationRequest(
        request_id="resp_1",
        messages=[
            Message("system", ["Be brief."]),
            Message("user", [text, *images]),
        ],
        sampling=SamplingParams(**sampling),
        kv_key=kv_key,
        cache_salt="key-1",
    )


def ranked(fakes: list[FakeUpstream], req: GenerationRequest) -> list[FakeUpstream]:
    """The fakes in the order the engine tries them for `req` (all healthy)."""
    replicas = [Replica(parse_upstream(f.url)) for f in fakes]
    for r in replicas:
        r.healthy = True
    by_name = {f.name: f for f in fakes}
    return [by_name[r.name] for r in Router(replicas).order(route_key(req))]


def photo_input(data: bytes, digest: str | None = None) -> ImageInput:
    return ImageInput(
        digest or hashlib.sha256(data).hexdigest(), None, data=data, mime="image/jpeg"
    )


# ------------------------------------------------------------------ start-up


async def test_start_learns_model_and_context() -> None:
    with FakeUpstream("org/Some-VLM-7B", max_model_len=32768) as a:
        async with started(a) as engine:
            assert engine.ready
            assert engine.model_id == "org/Some-VLM-7B"
            assert engine.context_tokens == 32768
            assert engine.image_input == "bytes"
        async with started(a, context_tokens=4096, model_id="vlm") as engine:
            assert engine.context_tokens == 4096  # a configured limit under the replica's
            assert engine.model_id == "vlm"


async def test_start_fails_naming_the_replicas_never_their_keys() -> None:
    ports = [free_port(), free_port()]
    env = {"UPSTREAM_KEY": "sk-very-secret-key"}
    upstreams = [
        parse_upstream(f"http://127.0.0.1:{p}#api_key_env=UPSTREAM_KEY", env) for p in ports
    ]
    engine = OpenAIEngine(upstreams, connect_timeout_s=1.0, start_timeout_s=1.5)
    with pytest.raises(EngineError) as info:
        await engine.start()
    await engine.aclose()
    message = str(info.value)
    assert info.value.code == "upstream_error"
    assert all(f"127.0.0.1:{p}" in message for p in ports)
    assert "sk-very-secret-key" not in message
    assert not engine.ready


async def test_start_waits_for_a_replica_that_comes_up_later() -> None:
    """Replicas often start with the gateway: start() asks again until one answers."""
    port = free_port()
    engine = OpenAIEngine([parse_upstream(f"http://127.0.0.1:{port}")], start_timeout_s=60)
    starting = asyncio.create_task(engine.start())
    await asyncio.sleep(1.5)
    assert not starting.done() and not engine.ready
    with FakeUpstream(port=port):
        await asyncio.wait_for(starting, 30)
        try:
            assert engine.ready and engine.model_id
        finally:
            await engine.aclose()


async def test_bearer_key_sent_to_the_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeUpstream() as a:
        up = parse_upstream(f"{a.url}#api_key_env=K&model=served-name", {"K": "sk-abc"})
        engine = OpenAIEngine([up])
        await engine.start()
        try:
            await collect(engine, request())
        finally:
            await engine.aclose()
        assert {r.headers.get("authorization") for r in a.requests} == {"Bearer sk-abc"}
        assert a.chat_requests()[0].body["model"] == "served-name"


async def test_embeds_mode_refuses_a_replica_serving_another_checkpoint() -> None:
    with FakeUpstream("Qwen/Qwen2.5-VL-7B-Instruct") as a:
        engine = OpenAIEngine(
            [parse_upstream(a.url)], image_input="embeds", checkpoint_name="llava-1.5-7b-hf"
        )
        with pytest.raises(EngineError, match="llava-1.5-7b-hf") as info:
            await engine.start()
        await engine.aclose()
        assert "Qwen2.5-VL-7B-Instruct" in str(info.value)
        # the same checkpoint, served from a local path: its root's last component matches
        a.models = [{"id": "vlm", "root": "/models/Qwen2.5-VL-7B-Instruct", "max_model_len": 8192}]
        async with started(
            a, image_input="embeds", checkpoint_name="Qwen2.5-VL-7B-Instruct"
        ) as engine:
            assert engine.ready and engine.model_id == "vlm"


def test_from_settings(tmp_path: Path) -> None:
    from gateway.settings import Settings

    ckpt = tmp_path / "Qwen2.5-VL-3B-Instruct"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 2048}}))
    settings = Settings(
        engine="openai",
        upstreams=["http://127.0.0.1:9001,http://127.0.0.1:9002#model=m2"],
        upstream_model="m1",
        upstream_images="embeds",
        upstream_context_tokens=16384,
        model_path=str(ckpt),
    )
    engine = OpenAIEngine.from_settings(settings)
    assert engine.image_input == "embeds"
    # embeds: warm-ups go upstream, and an image's tokens are known before it is sent
    assert engine.capabilities == EngineCapabilities(image_input="embeds", warm_up=True)
    assert engine.hidden_size == 2048
    assert engine.context_tokens == 16384
    assert [r.model for r in engine._router.replicas] == ["m1", "m2"]
    assert engine._pool.checkpoint == "Qwen2.5-VL-3B-Instruct"
    plain = OpenAIEngine.from_settings(
        Settings(engine="openai", upstreams=["http://127.0.0.1:9001"])
    )
    assert plain.image_input == "bytes" and plain.hidden_size == 0
    # bytes: no warm-up (the session warm-up has no bytes to send), and an image counts as the
    # settings' estimate until the replica encodes it
    assert plain.capabilities == EngineCapabilities(
        image_input="bytes", warm_up=False, image_tokens_estimate=settings.upstream_image_tokens
    )
    assert plain.capabilities.vocab_size is None and plain.capabilities.embedding_rms is None


def test_token_count_estimate_without_a_tokenizer() -> None:
    engine = OpenAIEngine([Upstream("http://127.0.0.1:1", name="127.0.0.1:1")])
    assert engine.count_tokens("abcdefg") == 3  # 7 bytes / 3, rounded up
    assert engine.count_tokens("é") == 1


# ------------------------------------------------------------------ request bodies


async def test_chat_body_in_bytes_mode() -> None:
    photo = photo_bytes("astronaut", size=64)
    digest = hashlib.sha256(photo).hexdigest()
    with FakeUpstream() as a:
        async with started(a) as engine:
            req = request(
                images=(photo_input(photo),),
                max_output_tokens=40,
                temperature=0.7,
                top_p=0.9,
                seed=7,
                stop=("\n\n",),
                logprobs=2,
            )
            req.messages.append(Message("assistant", ["An astronaut."]))
            req.messages.append(Message("user", ["And the flag?", "Be precise."]))
            await collect(engine, req)
            # a per-key content id (not the bytes' own digest): no content_hash
            scoped = "f" * 64
            await collect(engine, request(images=(photo_input(photo, scoped),)))
    first, second = (r.body for r in a.chat_requests())
    assert a.chat_requests()[0].path == "/v1/chat/completions"
    data_url = "data:image/jpeg;base64," + base64.b64encode(photo).decode()
    assert first == {
        "model": "fake-vlm",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in the photo?"},
                    {
                        "type": "image_url",
                        "image_url": {"url": data_url, "content_hash": f"sha256:{digest}"},
                        "uuid": digest,
                    },
                ],
            },
            {"role": "assistant", "content": "An astronaut."},
            {"role": "user", "content": "And the flag?\nBe precise."},
        ],
        # vLLM's prefix-cache namespace: a hash of the API key's owner id ("key-1")
        "cache_salt": hashlib.sha256(b"visiongate-cache-salt\0key-1").hexdigest(),
        "max_tokens": 40,
        "max_completion_tokens": 40,
        "temperature": 0.7,
        "top_p": 0.9,
        "n": 1,
        "seed": 7,
        "stop": ["\n\n"],
        "logprobs": True,
        "top_logprobs": 2,
    }
    image = second["messages"][1]["content"][1]
    assert image == {"type": "image_url", "image_url": {"url": data_url}, "uuid": scoped}


async def test_large_images_rendered_off_the_loop_and_reused() -> None:
    big = bytes(range(256)) * (6 * 4096)  # 6 MiB: rendered on a worker thread
    image = ImageInput(hashlib.sha256(big).hexdigest(), None, data=big, mime="image/png")
    with FakeUpstream() as a:
        async with started(a) as engine:
            for turn in range(2):  # the second turn reuses the rendered part
                await collect(engine, request(f"turn {turn}", images=(image,)))
    urls = [r.body["messages"][1]["content"][1]["image_url"]["url"] for r in a.chat_requests()]
    assert urls == ["data:image/png;base64," + base64.b64encode(big).decode()] * 2


def _saved_tensor_bytes(b64: str) -> bytes:
    """The raw storage of a `torch.save` archive, read as a zip (nothing is unpickled)."""
    with zipfile.ZipFile(io.BytesIO(base64.b64decode(b64))) as archive:
        names = archive.namelist()
        assert any(n.endswith("/data.pkl") for n in names)
        (storage,) = [n for n in names if n.endswith("/data/0")]
        return archive.read(storage)


async def test_chat_body_in_embeds_mode() -> None:
    tokens = torch.randn(4, 8)
    digest = "0123456789abcdef:" + "a" * 64
    qwen = ImageInput(
        "fedcba9876543210:" + "b" * 64,
        torch.randn(4, 8),
        layout=ImageLayout("<|image_pad|>", (4,), mrope=(0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 1, 1)),
    )
    with FakeUpstream(model="llava-1.5-7b-hf") as a:
        async with started(a, image_input="embeds", checkpoint_name="llava-1.5-7b-hf") as eng:
            await collect(eng, request(images=(ImageInput(digest, tokens),)))
            await collect(eng, request(images=(qwen,)))
    plain, grid = (r.body["messages"][1]["content"][1] for r in a.chat_requests())
    assert plain["type"] == "image_embeds" and plain["uuid"] == digest
    assert set(plain) == {"type", "image_embeds", "uuid"}
    assert _saved_tensor_bytes(plain["image_embeds"]) == tokens.numpy().tobytes()
    # M-RoPE (Qwen2-VL family): the dict form with the image's patch grid before the 2x2 merge
    assert grid["uuid"] == qwen.digest
    assert set(grid["image_embeds"]) == {"image_embeds", "image_grid_thw"}
    thw = _saved_tensor_bytes(grid["image_embeds"]["image_grid_thw"])
    assert torch.frombuffer(bytearray(thw), dtype=torch.int64).tolist() == [1, 4, 4]


async def test_raw_prompt_uses_completions() -> None:
    with FakeUpstream() as a:
        async with started(a) as engine:
            req = GenerationRequest(
                "c1",
                [],
                sampling=SamplingParams(max_output_tokens=5, logprobs=1),
                raw_prompt="1+1=",
            )
            deltas, (result,) = await collect(engine, req)
    recorded = a.chat_requests()[0]
    assert recorded.path == "/v1/completions"
    assert recorded.body["prompt"] == "1+1=" and "messages" not in recorded.body
    assert recorded.body["logprobs"] == 1 and "max_completion_tokens" not in recorded.body
    assert result.text == "Hello, world"


async def test_grammar_goes_as_structured_outputs() -> None:
    """Tools and response formats reach a replica as the grammar the gateway planned (vLLM's
    `structured_outputs.grammar`), on chat completions and completions alike, once the replica
    showed that it applies such grammars (asked once)."""
    from gateway.engine.upstream.grammar_probe import PROBE_ANSWER, PROBE_GRAMMAR

    grammar = 'start: "yes" | "no"'
    with FakeUpstream() as a:
        a.scripts.append(Script(chunks=[PROBE_ANSWER]))  # as vLLM with llguidance answers
        async with started(a) as engine:
            await collect(engine, request(grammar=grammar))
            await collect(
                engine,
                GenerationRequest(
                    "c1", [], sampling=SamplingParams(grammar=grammar), raw_prompt="Yes or no?"
                ),
            )
            await collect(engine, request())
    probe, chat, completion, plain = (r.body for r in a.chat_requests())
    assert probe["structured_outputs"] == {"grammar": PROBE_GRAMMAR}
    assert not probe.get("stream")
    assert chat["structured_outputs"] == {"grammar": grammar}
    assert completion["structured_outputs"] == {"grammar": grammar}
    assert "structured_outputs" not in plain
    assert "tools" not in chat and "response_format" not in chat  # planned into the prompt


async def test_a_replica_that_ignores_grammars_gets_none() -> None:
    """A replica that answers the probe freely (a server that ignores the field) or fails it
    (vLLM's xgrammar backend: HTTP 500) gets no constrained request: they go to a replica that
    applies grammars, and are refused when there is none."""
    from gateway.engine.upstream.grammar_probe import PROBE_ANSWER

    with FakeUpstream() as free, FakeUpstream() as failing, FakeUpstream() as able:
        failing.scripts.append(Script(status=500))
        able.scripts.append(Script(chunks=[PROBE_ANSWER]))
        async with started(free, failing, able) as engine:
            for _ in range(3):
                await collect(engine, request(grammar='start: "yes"', kv_key=None))
        async with started(free, failing) as engine:
            with pytest.raises(EngineError) as info:
                await collect(engine, request(grammar='start: "yes"'))
            await collect(engine, request())  # unconstrained requests are not affected
    assert len(able.chat_requests()) == 4  # the probe, then every constrained request
    assert info.value.code == "invalid_request" and "guidance" in str(info.value)
    assert all(
        "structured_outputs" not in r.body or not r.body.get("stream")
        for r in (*free.chat_requests(), *failing.chat_requests())
    )


async def test_a_replica_refusing_the_grammar_is_passed_on() -> None:
    from gateway.engine.upstream.grammar_probe import PROBE_ANSWER

    error = {"error": {"message": "Invalid grammar specification: bad rule", "code": 400}}
    with FakeUpstream() as a:
        a.scripts += [Script(chunks=[PROBE_ANSWER]), Script(status=400, error=error)]
        async with started(a) as engine:
            with pytest.raises(EngineError) as info:
                await collect(engine, request(grammar='start: "yes" | "no"'))
    assert info.value.code == "invalid_request"
    assert "output grammar" in str(info.value) and "bad rule" in str(info.value)
    assert len(a.chat_requests()) == 2  # the probe; then a client's error, not tried elsewhere


async def test_warm_up_prefills_on_the_replica_of_the_next_turn() -> None:
    """A KV warm-up is the conversation as a one-token request on the replica the session's
    next turn goes to, with its cache salt; nothing goes to a replica that is busy."""
    with FakeUpstream() as a, FakeUpstream() as b:
        fakes = [a, b]
        warm = request(kv_key="session-7")
        first = ranked(fakes, warm)[0]
        first.default = Script(chunks=["x"], first_delay_s=0.5)
        async with started(a, b) as engine:
            result = await engine.warm_up(warm)
            turn = asyncio.create_task(collect(engine, request("Next?", kv_key="session-7")))
            await wait_until_async(lambda: len(first.chat_requests()) == 2)
            busy = await engine.warm_up(request(kv_key="session-7"))
            await turn
            unkeyed = await engine.warm_up(request(kv_key=None))
    assert (result.outcome, result.positions, result.computed) == ("warmed", 21, 5)
    sent, then = (r.body for r in first.chat_requests()[:2])
    assert sent["max_tokens"] == 1 and sent["messages"] == warm_body_messages(warm)
    assert sent["cache_salt"] == then["cache_salt"]
    assert busy.outcome == "dropped" and "busy" in busy.reason
    assert unkeyed.outcome == "failed"
    assert len(first.chat_requests()) == 2
    assert not next(f for f in fakes if f is not first).chat_requests()


def warm_body_messages(req: GenerationRequest) -> list[dict]:
    return [{"role": m.role, "content": "\n".join(m.content)} for m in req.messages]


async def wait_until_async(check, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------ streaming and usage


async def test_image_tokens_from_vllms_multimodal_count() -> None:
    """vLLM leaves `image_tokens` null and counts placeholders by modality instead."""
    usage = {
        "prompt_tokens": 35,
        "completion_tokens": 3,
        "prompt_tokens_details": {
            "cached_tokens": 32,
            "image_tokens": None,
            "multimodal_tokens": {"image": 9},
        },
    }
    odd = {**usage, "prompt_tokens_details": {"multimodal_tokens": {"image": None}}}
    with FakeUpstream() as a:
        a.scripts += [Script(usage=usage), Script(usage=odd)]
        async with started(a) as engine:
            _, (result,) = await collect(engine, request())
            _, (unread,) = await collect(engine, request())
    assert (result.input_tokens, result.cached_tokens, result.image_tokens) == (35, 32, 9)
    assert unread.image_tokens == 0 and unread.text == "Hello, world"


async def test_deltas_usage_and_timings() -> None:
    with FakeUpstream() as a:
        a.default = Script(chunks=["The", " sky", " is", " blue"], delay_s=0.01)
        async with started(a) as engine:
            deltas, (result,) = await collect(engine, request())
    assert [d.text for d in deltas] == ["The", " sky", " is", " blue"]
    assert result.text == "The sky is blue" and result.finish_reason == "stop"
    assert (result.input_tokens, result.cached_tokens, result.output_tokens) == (21, 16, 3)
    assert result.image_tokens == 0
    assert result.ttft_ms > 0 and result.ttft_ms == result.prefill_ms
    assert result.decode_ms > 0 and len(result.itl_ms) == 3
    assert result.queue_ms >= 0


async def test_length_finish_logprobs_and_choices() -> None:
    with FakeUpstream() as a:
        a.scripts.append(Script(finish_reason="length", logprobs=True))
        a.scripts.append(
            Script(
                chunks=["a", "b"],
                n=2,
                finish_reason="tool_calls",
                usage={"prompt_tokens": 5, "completion_tokens": 8},
            )
        )
        # vLLM's "abort" (and any reason that is not an end) is the answer cut short upstream
        a.scripts.append(Script(chunks=["cut"], finish_reason="abort"))
        async with started(a) as engine:
            deltas, (result,) = await collect(engine, request(logprobs=1))
            assert result.finish_reason == "length"
            first = deltas[0].logprobs[0]
            assert (first.token, first.logprob, first.bytes) == ("Hello", -0.5, b"Hello")
            assert first.top == (("Hello", -0.5, b"Hello"),)
            deltas, results = await collect(engine, request(n=2))
            with pytest.raises(EngineError) as aborted:
                await collect(engine, request())
    assert aborted.value.code == "upstream_error" and "abort" in str(aborted.value)
    assert [r.index for r in results] == [0, 1]
    assert [r.text for r in results] == ["ab", "ab"]
    assert [r.finish_reason for r in results] == ["stop", "stop"]  # a whole answer: stop
    assert [r.output_tokens for r in results] == [4, 4]  # 8 split by chunks streamed
    assert {d.index for d in deltas} == {0, 1}


# ------------------------------------------------------------------ failover and errors


@pytest.mark.parametrize("failure", ["http_503", "refused", "dropped"])
async def test_failover_before_the_first_token(failure: str) -> None:
    with FakeUpstream() as a, FakeUpstream() as b:
        req = request(kv_key="failover-" + failure)
        first, second = ranked([a, b], req)
        if failure == "http_503":
            first.scripts.append(Script(status=503))
        elif failure == "dropped":
            first.scripts.append(Script(drop_after=0))  # the role chunk, then nothing
        async with started(a, b) as engine:
            if failure == "refused":
                first.set_listening(False)
            deltas, (result,) = await collect(engine, req)
            down = {r.name: r.healthy for r in engine._router.replicas}
    assert "".join(d.text for d in deltas) == "Hello, world"  # once: nothing duplicated
    assert result.text == "Hello, world"
    assert len(second.chat_requests()) == 1
    assert down[first.name] is False and down[second.name] is True


async def test_failure_after_the_first_token_is_an_upstream_error() -> None:
    with FakeUpstream() as a, FakeUpstream() as b:
        req = request(kv_key="mid-stream")
        first, second = ranked([a, b], req)
        first.scripts.append(Script(chunks=["one", " two", " three"], drop_after=1))
        async with started(a, b) as engine:
            deltas = []
            with pytest.raises(EngineError) as info:
                async for item in engine.generate(req):
                    deltas.append(item)
    assert info.value.code == "upstream_error"
    assert [d.text for d in deltas] == ["one"]
    assert not second.chat_requests()  # text was out: no second try


async def test_error_in_the_stream_after_text() -> None:
    with FakeUpstream() as a:
        a.scripts.append(Script(stream_error="engine died at /opt/internal/path.py"))
        async with started(a) as engine:
            with pytest.raises(EngineError) as info:
                await collect(engine, request())
    assert info.value.code == "upstream_error"
    assert "/opt/internal" not in str(info.value)  # the upstream's own words stay in the log


@pytest.mark.parametrize(
    ("status", "error", "code"),
    [
        (
            400,
            {
                "object": "error",
                "message": "This model's maximum context length is 4096 tokens. However, "
                "you requested 5000 tokens.",
                "code": 400,
            },
            "context_length_exceeded",
        ),
        (
            400,
            {"error": {"message": "top_p must be in (0, 1]", "code": "bad_param"}},
            "invalid_request",
        ),
        (413, {"object": "error", "message": "payload too large"}, "input_too_large"),
        (401, {"error": {"message": "invalid api key"}}, "upstream_error"),
        (404, {"error": {"message": "model not found"}}, "upstream_error"),
    ],
)
async def test_client_errors_map_without_failover(status: int, error: dict, code: str) -> None:
    with FakeUpstream() as a, FakeUpstream() as b:
        req = request(kv_key=f"status-{status}-{code}")
        first, second = ranked([a, b], req)
        first.scripts.append(Script(status=status, error=error))
        async with started(a, b) as engine:
            with pytest.raises(EngineError) as info:
                await collect(engine, req)
            healthy = all(r.healthy for r in engine._router.replicas)
    assert info.value.code == code
    assert not isinstance(info.value, EngineBusy)
    assert not second.chat_requests()
    assert healthy  # the replica works; the request (or the configuration) was wrong
    if code == "invalid_request":
        assert "top_p must be in (0, 1]" in str(info.value)


async def test_429_tries_the_next_replica_then_reports_busy() -> None:
    with FakeUpstream() as a, FakeUpstream() as b:
        req = request(kv_key="busy")
        first, second = ranked([a, b], req)
        first.scripts.append(Script(status=429, headers={"retry-after": "7"}))
        async with started(a, b) as engine:
            deltas, _ = await collect(engine, req)
            assert "".join(d.text for d in deltas) == "Hello, world"
            assert all(r.healthy for r in engine._router.replicas)  # 429 is not "down"

            for fake, after in ((first, "7"), (second, "3")):
                fake.scripts.append(Script(status=429, headers={"retry-after": after}))
            with pytest.raises(EngineBusy) as info:
                await collect(engine, req)
    assert info.value.retry_after_s == 3.0


async def test_all_replicas_failing_is_an_upstream_error() -> None:
    with FakeUpstream() as a, FakeUpstream() as b:
        a.scripts.append(Script(status=500))
        b.scripts.append(Script(status=502))
        async with started(a, b) as engine:
            with pytest.raises(EngineError) as info:
                await collect(engine, request())
    assert info.value.code == "upstream_error" and not isinstance(info.value, EngineBusy)
    # the replicas' addresses and error bodies are the operator's, in the log, not the client's
    assert a.name not in str(info.value) and b.name not in str(info.value)
    assert "2 tried" in str(info.value)


# ------------------------------------------------------------------ cancellation


async def test_cancel_closes_the_upstream_stream_while_nothing_arrives() -> None:
    with FakeUpstream() as a:
        a.default = Script(chunks=["first", " second", " third"], delay_s=60.0)
        async with started(a) as engine:
            req = request()
            stream = engine.generate(req)
            first = await stream.__anext__()
            assert isinstance(first, TextDelta) and first.text == "first"
            req.cancel.set()
            rest = [item async for item in stream]
            # the fake sees the client leave long before its next chunk (60 s away)
            assert await asyncio.to_thread(a.disconnected.wait, 10.0)
            assert engine.stats().running == 0
    (result,) = rest
    assert isinstance(result, GenerationResult)
    assert result.finish_reason == "cancelled" and result.text == "first"
    assert a.chunks_sent == 1
    assert a.disconnects == ["/v1/chat/completions"]


async def test_closing_the_iterator_closes_the_upstream_stream() -> None:
    with FakeUpstream() as a:
        a.default = Script(chunks=["first", " second"], delay_s=60.0)
        async with started(a) as engine:
            stream = engine.generate(request())
            assert (await stream.__anext__()).text == "first"
            await stream.aclose()
            assert await asyncio.to_thread(a.disconnected.wait, 10.0)
            assert engine.stats().running == 0
    assert a.chunks_sent == 1


async def test_cancel_before_the_first_token() -> None:
    with FakeUpstream() as a:
        a.default = Script(first_delay_s=60.0)
        async with started(a) as engine:
            req = request()
            stream = engine.generate(req)
            task = asyncio.ensure_future(stream.__anext__())
            await asyncio.to_thread(wait_until, lambda: bool(a.chat_requests()))
            req.cancel.set()
            result = await task
            assert isinstance(result, GenerationResult) and result.finish_reason == "cancelled"
            assert await asyncio.to_thread(a.disconnected.wait, 10.0)
            await stream.aclose()


# ------------------------------------------------------------------ telemetry


async def test_attempt_metrics_and_spans() -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.telemetry import Telemetry, config_from_env

    telemetry = Telemetry(config_from_env({}), "0.0.0-test", "test")
    spans = InMemorySpanExporter()
    telemetry.tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    try:
        with FakeUpstream() as a, FakeUpstream() as b:
            req = request(kv_key="observed")
            first, second = ranked([a, b], req)
            first.scripts.append(Script(status=500))
            upstreams = [parse_upstream(a.url), parse_upstream(b.url)]
            engine = OpenAIEngine(upstreams, health_interval_s=60.0)
            engine.bind_telemetry(telemetry)
            await engine.start()
            try:
                await collect(engine, req)
            finally:
                await engine.aclose()
        body, _ = telemetry.prometheus_text()
        rows = [
            (s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
        ]
    finally:
        telemetry.shutdown()

    def value(name: str, **labels: str) -> float:
        found = [v for n, lab, v in rows if n == name and labels.items() <= lab.items()]
        assert len(found) == 1, (name, labels, found)
        return found[0]

    requests = "visiongate_upstream_requests_total"
    assert value(requests, upstream=first.name, outcome="failover") == 1
    assert value(requests, upstream=second.name, outcome="ok") == 1
    ttft = "visiongate_upstream_time_to_first_token_seconds_count"
    assert value(ttft, upstream=second.name) == 1
    assert value("visiongate_upstream_healthy", upstream=first.name) == 0
    assert value("visiongate_upstream_healthy", upstream=second.name) == 1
    assert value("visiongate_upstream_in_flight", upstream=second.name) == 0

    attempts = [s for s in spans.get_finished_spans() if s.name == "upstream.request"]
    described = sorted(
        (
            s.attributes["visiongate.upstream.attempt"],
            s.attributes["visiongate.upstream.name"],
            s.attributes["http.response.status_code"],
            s.attributes["visiongate.upstream.outcome"],
        )
        for s in attempts
    )
    assert described == [(1, first.name, 500, "failover"), (2, second.name, 200, "ok")]
    # each attempt's span context went upstream as a W3C traceparent
    sent = second.chat_requests()[0].headers["traceparent"]
    ok_span = next(s for s in attempts if s.attributes["visiongate.upstream.outcome"] == "ok")
    assert sent.split("-")[1] == format(ok_span.context.trace_id, "032x")


# ------------------------------------------------------------------ the whole gateway


def test_gateway_streams_an_image_chat_through_an_upstream() -> None:
    from gateway.server.app import create_app
    from gateway.server.runner import ServerThread
    from gateway.settings import Settings

    photo = photo_bytes("astronaut", size=128)
    digest = hashlib.sha256(photo).hexdigest()
    with FakeUpstream("org/Upstream-VLM") as upstream:
        upstream.default = Script(chunks=["An", " astronaut", "."])
        settings = Settings(engine="openai", upstreams=[upstream.url], port=free_port())
        server = ServerThread(create_app(settings), settings, port=settings.port).start()
        try:
            server.wait_ready(timeout=60)
            client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
            stream = client.chat.completions.create(
                model="org/Upstream-VLM",
                stream=True,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {
                                "type": "image_url",
                                "image_url": {
                                    "url": "data:image/jpeg;base64,"
                                    + base64.b64encode(photo).decode()
                                },
                            },
                        ],
                    }
                ],
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            # the replica goes away: the health loop marks it down and /readyz says so
            upstream.set_listening(False)
            assert wait_until(lambda: httpx.get(f"{server.http_url}/readyz").status_code == 503)
            body = httpx.get(f"{server.http_url}/readyz").json()
        finally:
            server.server.should_exit = True
            server.thread.join(timeout=30)
    assert text == "An astronaut."
    assert body["missing"] == ["upstreams"] and body["status"] == "not_ready"
    (sent,) = upstream.chat_requests()
    user = next(m for m in sent.body["messages"] if m["role"] == "user")
    image = next(p for p in user["content"] if p["type"] == "image_url")
    assert image["image_url"]["url"] == "data:image/jpeg;base64," + base64.b64encode(photo).decode()
    assert image["uuid"] == digest
    assert image["image_url"]["content_hash"] == f"sha256:{digest}"
    assert sent.body["stream"] is True and sent.body["model"] == "org/Upstream-VLM"


# ------------------------------------------------------------------ the event stream's framing


@asynccontextmanager
async def raw_replica(pieces: list[bytes]) -> AsyncIterator[str]:
    """A replica written byte by byte on a loopback socket: /v1/models answers, and a chat
    completion answers `pieces` as the chunks of a chunked body (each flushed on its own), so
    events can be cut anywhere. Stands in for an upstream whose writes split lines oddly."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"content-length: (\d+)", head.lower())
                if length is not None:
                    await reader.readexactly(int(length.group(1)))
                if head.startswith(b"GET"):
                    body = b'{"object":"list","data":[{"id":"raw","object":"model"}]}'
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(body), body)
                    )
                    await writer.drain()
                    continue
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                for piece in pieces:
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    await writer.drain()
                    await asyncio.sleep(0.01)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


def _event(text: str | None, finish: str | None = None) -> bytes:
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {} if text is None else {"content": text}}],
    }
    if finish:
        chunk["choices"][0]["finish_reason"] = finish
        chunk["usage"] = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    return b"data: " + json.dumps(chunk).encode() + b"\r\n\r\n"


async def test_events_cut_anywhere_are_read_whole() -> None:
    stream = b": a comment\n\n" + _event("Hel") + _event("lo") + _event(None, "stop")
    stream += b"data: [DONE]\n\n"
    pieces = [stream[i : i + 7] for i in range(0, len(stream), 7)]  # lines cut mid-way
    async with raw_replica(pieces) as url, started(url, start_timeout_s=5) as engine:
        deltas, results = await collect(engine, request())
    assert "".join(d.text for d in deltas) == "Hello"
    assert results[0].finish_reason == "stop" and results[0].output_tokens == 2


async def test_an_endless_event_line_fails_the_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.engine.upstream.sse as module

    monkeypatch.setattr(module, "MAX_SSE_LINE_BYTES", 4096)
    pieces = [b"data: " + b"x" * 1024] * 8  # never a newline
    async with raw_replica(pieces) as url, started(url, start_timeout_s=5) as engine:
        with pytest.raises(EngineError) as caught:
            await collect(engine, request())
    assert caught.value.code == "upstream_error"


# ------------------------------------------------------------------ upstreams that misbehave


async def test_an_error_in_the_stream_before_text_is_the_clients_when_it_says_so() -> None:
    """vLLM reports a refusal found after its response began (a prompt too long once its
    images are expanded) as an error object in the stream: the client's error, one attempt,
    and no replica marked down."""
    with FakeUpstream() as a, FakeUpstream() as b:
        for fake in (a, b):
            fake.scripts.append(
                Script(
                    chunks=[],
                    stream_error="This model's maximum context length is 4096 tokens",
                    stream_error_code=400,
                )
            )
        async with started(a, b) as engine:
            with pytest.raises(EngineError) as info:
                await collect(engine, request())
            assert all(r.healthy for r in engine._replicas)
    assert info.value.code == "context_length_exceeded"
    assert len(a.chat_requests()) + len(b.chat_requests()) == 1


@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "99999999999"])
async def test_an_odd_retry_after_is_bounded(value: str) -> None:
    with FakeUpstream() as a:
        a.scripts.append(Script(status=429, headers={"retry-after": value}))
        async with started(a) as engine:
            with pytest.raises(EngineBusy) as info:
                await collect(engine, request())
    assert 0 < info.value.retry_after_s <= 60


async def test_an_upstream_ignoring_max_tokens_is_stopped_there() -> None:
    with FakeUpstream() as a:
        a.scripts.append(Script(chunks=[f" w{i}" for i in range(200)], delay_s=0.005))
        async with started(a) as engine:
            deltas, (result,) = await collect(engine, request(max_output_tokens=5))
            assert engine.stats().running == 0
    assert len(deltas) == 5 and result.finish_reason == "length"


async def test_an_upstream_ignoring_n_is_a_failure_not_empty_answers() -> None:
    with FakeUpstream() as a:
        a.scripts.append(Script(chunks=["only", " one"], n=1))
        async with started(a) as engine:
            with pytest.raises(EngineError) as info:
                await collect(engine, request(n=2))
    assert info.value.code == "upstream_error"


async def test_a_replica_coming_up_later_with_a_smaller_context_lowers_it() -> None:
    port = free_port()
    with FakeUpstream(max_model_len=32768) as a:
        late = parse_upstream(f"http://127.0.0.1:{port}")
        engine = OpenAIEngine([parse_upstream(a.url), late], health_interval_s=0.2)
        await engine.start()
        try:
            assert engine.context_tokens == 32768
            with FakeUpstream(max_model_len=4096, port=port):
                assert await asyncio.to_thread(
                    wait_until, lambda: engine.context_tokens == 4096, 10.0
                )
        finally:
            await engine.aclose()


async def test_an_answer_of_exactly_max_tokens_keeps_its_usage() -> None:
    """The last text chunk reaches max_tokens; the finish and usage chunks after it are read."""
    with FakeUpstream() as a:
        a.scripts.append(Script(finish_reason="length"))  # three text chunks
        async with started(a) as engine:
            deltas, (result,) = await collect(engine, request(max_output_tokens=3))
    assert len(deltas) == 3 and result.finish_reason == "length"
    assert (result.input_tokens, result.cached_tokens) == (21, 16)


async def test_cr_only_line_ends_are_line_ends() -> None:
    """The event-stream format allows \\r, \\n or \\r\\n; a \\r\\n may be cut between reads."""
    stream = (_event("a") + _event("b") + _event(None, "stop") + b"data: [DONE]\n\n").replace(
        b"\r\n", b"\r"
    )
    for pieces in ([stream], [stream[i : i + 5] for i in range(0, len(stream), 5)]):
        async with raw_replica(pieces) as url, started(url, start_timeout_s=5) as engine:
            deltas, (result,) = await collect(engine, request())
        assert "".join(d.text for d in deltas) == "ab" and result.finish_reason == "stop"


async def test_the_last_frame_at_max_tokens_keeps_its_finish_reason() -> None:
    """A replica sends one text frame per token and then a frame with only the finish reason
    (and the last token's log-probabilities): at exactly max_tokens that is an ordinary end,
    not an overrun. A filtered or otherwise named end is an end too, not a failure."""
    last = {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }
    stream = _event("a") + _event("b") + b"data: " + json.dumps(last).encode() + b"\n\n"
    pieces = [stream + b"data: [DONE]\n\n"]
    async with raw_replica(pieces) as url, started(url, start_timeout_s=5) as engine:
        deltas, (result,) = await collect(engine, request(max_output_tokens=2))
    assert "".join(d.text for d in deltas) == "ab"
    assert (result.finish_reason, result.output_tokens) == ("stop", 2)
    with FakeUpstream() as a:
        a.scripts.append(Script(finish_reason="content_filter"))
        async with started(a) as engine:
            _, (filtered,) = await collect(engine, request())
    assert filtered.finish_reason == "stop" and filtered.text == "Hello, world"


@pytest.mark.parametrize("merge", [1, 2])
def test_qwen_grid_follows_the_checkpoints_spatial_merge(merge: int, tmp_path: Path) -> None:
    """The image_grid_thw a replica gets for a Qwen2.5-VL image is the checkpoint processor's
    own, whatever the checkpoint's spatial merge size (1 merges nothing, 2 is 2x2)."""
    import msgspec
    import skimage.data
    from PIL import Image

    from encoder_worker.families import load_family
    from gateway.engine.upstream.wire import render_image
    from tests.vlm_checkpoints import qwen2_5_vl as builder

    side = builder.PATCH * merge
    checkpoint = builder.build(
        tmp_path / f"qwen-merge{merge}",
        vision={"spatial_merge_size": merge},
        min_pixels=side**2 * 4,
        max_pixels=side**2 * 40,
    )
    family = load_family(checkpoint, torch.device("cpu"), torch.float32)
    rgb = skimage.data.rocket()  # 427 x 640: a grid wider than tall
    out = family.encode(rgb)
    layout = family.layout(out.runs, out)
    assert layout.mrope_merge == merge
    # the layout reaches the gateway inside the vision-cache entry's msgpack header
    layout = msgspec.msgpack.decode(msgspec.msgpack.encode(layout), type=ImageLayout)
    part, _ = render_image(ImageInput("ab" * 32, out.embeds, layout=layout), "embeds")
    thw = _saved_tensor_bytes(part["image_embeds"]["image_grid_thw"])
    got = torch.frombuffer(bytearray(thw), dtype=torch.int64).view(-1, 3).tolist()
    processor = builder.load_processor(checkpoint).image_processor
    expected = processor(images=[Image.fromarray(rgb)], return_tensors="pt")["image_grid_thw"]
    assert got == expected.tolist()
    t, h, w = got[0]
    assert h != w and t * h * w == out.embeds.shape[0] * merge**2


def test_a_layout_stored_before_the_merge_size_reads_as_2x2() -> None:
    import msgspec

    old = msgspec.msgpack.encode(["<|image_pad|>", [4], [0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 1, 1], 2])
    assert msgspec.msgpack.decode(old, type=ImageLayout).mrope_merge == 2
