"""LocalEngine on the real model.

Covers streaming, limits, stop strings, cancellation, queueing and images.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from gateway.engine.interface import (
    Engine,
    EngineBusy,
    GenerationRequest,
    GenerationResult,
    ImageInput,
    Message,
    SamplingParams,
    TextDelta,
)
from gateway.testing.engine_requests import text_requests

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France? Answer in one sentence."
STORY = "Write a long story about a dragon who lives in a castle."


ask = text_requests("req", max_tokens=16)


def random_image(engine, n: int, seed: int, digest: str) -> ImageInput:
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(n, engine.hidden_size, generator=g)  # [N, H]
    embeds = embeds / embeds.pow(2).mean(dim=-1, keepdim=True).sqrt() * engine.embedding_rms
    return ImageInput(digest=digest, embeds=embeds)


async def test_engine_protocol_and_attributes(engine) -> None:
    assert isinstance(engine, Engine)
    assert engine.ready
    assert engine.model_id == "SmolLM2-135M-Instruct"
    assert engine.hidden_size == 576
    assert 0.01 < engine.embedding_rms < 10
    assert engine.count_tokens("Hello world") == 2
    # what the gateway reads instead of probing the engine, known once it started
    capabilities = engine.capabilities
    assert capabilities.image_input == "embeds" and capabilities.warm_up
    assert capabilities.embedding_rms == engine.embedding_rms
    assert capabilities.vocab_size == len(engine.tokenizer) > 49_000
    assert capabilities.image_tokens_estimate == 0  # its images arrive as visual tokens


async def test_stream_concatenates_to_result(engine, collect) -> None:
    deltas, result = await collect(engine, ask(QUESTION, 24))
    assert "".join(deltas) == result.text
    assert "Paris" in result.text
    assert result.finish_reason == "stop"
    assert len(deltas) > 1
    assert result.input_tokens > 10 and result.image_tokens == 0 and result.cached_tokens == 0
    assert 0 < result.output_tokens <= 24
    assert result.prefill_ms > 0 and result.decode_ms > 0 and result.ttft_ms > 0


async def test_max_output_tokens_is_length(engine, collect) -> None:
    deltas, result = await collect(engine, ask(STORY, 4))
    assert result.finish_reason == "length"
    assert result.output_tokens == 4
    assert "".join(deltas) == result.text and result.text


async def test_stop_string_cuts_before_it(engine, collect) -> None:
    _, full = await collect(engine, ask(QUESTION, 24))
    assert "Paris" in full.text
    deltas, result = await collect(engine, ask(QUESTION, 24, stop=("Paris",)))
    assert result.finish_reason == "stop"
    assert result.text == full.text[: full.text.index("Paris")]
    assert "".join(deltas) == result.text
    assert not any("Par" in d for d in deltas)


async def test_cancel_mid_stream_within_one_step(engine, collect) -> None:
    request = ask(STORY, 24)
    seen = 0
    result = None
    async for item in engine.generate(request):
        if isinstance(item, TextDelta):
            seen += 1
            if seen == 2:
                request.cancel.set()
        else:
            result = item
    assert isinstance(result, GenerationResult)
    assert result.finish_reason == "cancelled"
    assert result.output_tokens <= seen + 3  # the step already running (+ deltas in flight)
    assert result.output_tokens < 24


async def test_closing_iterator_frees_engine(engine, collect) -> None:
    request = ask(STORY, 24)
    stream = engine.generate(request)
    first = await anext(stream)
    assert isinstance(first, TextDelta)
    await stream.aclose()
    assert request.cancel.is_set()
    started = time.perf_counter()
    _, result = await collect(engine, ask(QUESTION, 8))
    assert result.finish_reason in ("stop", "length")
    assert result.queue_ms < 2000  # waited one decode step at most, not 20 more tokens
    assert time.perf_counter() - started < 30


async def test_task_cancellation_frees_engine(engine, collect) -> None:
    request = ask(STORY, 24)
    got_first = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(request):
            got_first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_first.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert request.cancel.is_set()
    _, result = await collect(engine, ask(QUESTION, 4))
    assert result.queue_ms < 2000


async def test_queue_full_is_busy_and_cancelled_waiter_never_runs(engine, collect) -> None:
    small = engine.replica(max_queue=1, max_batch=1)  # one running, one waiting
    await small.start()
    try:
        running = ask(STORY, 24)
        stream_a = small.generate(running)
        assert isinstance(await anext(stream_a), TextDelta)  # A is on the worker now
        waiting = ask(QUESTION, 8)
        stream_b = small.generate(waiting)
        next_b = asyncio.create_task(anext(stream_b))  # B takes the one queue slot
        await asyncio.sleep(0.05)
        with pytest.raises(EngineBusy) as info:
            await anext(small.generate(ask(QUESTION, 8)))
        assert info.value.code == "busy"
        waiting.cancel.set()  # cancelled while queued: never runs
        running.cancel.set()
        async for _ in stream_a:
            pass
        result_b = await next_b
        assert isinstance(result_b, GenerationResult)
        assert result_b.finish_reason == "cancelled" and result_b.output_tokens == 0
        assert result_b.input_tokens == 0 and result_b.text == ""
        await stream_b.aclose()
        _, after = await collect(small, ask(QUESTION, 4))  # the slot is free again
        assert after.output_tokens > 0
    finally:
        await small.aclose()


async def test_image_is_spliced_and_counted(engine, collect) -> None:
    image = random_image(engine, 8, seed=1, digest="a" * 64)
    with_image = GenerationRequest(
        "img",
        [Message("user", ["Describe this image.", image])],
        SamplingParams(max_output_tokens=8),
    )
    deltas, result = await collect(engine, with_image)
    _, text_only = await collect(engine, ask("Describe this image.", 8))
    assert result.image_tokens == 8
    assert result.input_tokens >= text_only.input_tokens + 8
    assert "".join(deltas) == result.text


async def test_wrong_image_width_is_an_error(engine) -> None:
    from gateway.engine.interface import EngineError

    bad = ImageInput("b" * 64, torch.zeros(4, 100))
    request = GenerationRequest("bad", [Message("user", ["Look", bad])])
    with pytest.raises(EngineError) as info:
        async for _ in engine.generate(request):
            pass
    assert info.value.code == "invalid_image"


async def test_seeded_sampling_is_reproducible(engine, collect) -> None:
    first = await collect(engine, ask(STORY, 12, temperature=0.9, top_p=0.9, seed=1234))
    second = await collect(engine, ask(STORY, 12, temperature=0.9, top_p=0.9, seed=1234))
    assert first[1].text == second[1].text
    assert first[1].output_tokens == second[1].output_tokens


async def test_prompt_past_the_context_is_an_error(engine) -> None:
    from gateway.engine.interface import EngineError

    request = ask("word " * 9000, 4)
    with pytest.raises(EngineError) as info:
        async for _ in engine.generate(request):
            pass
    assert info.value.code == "context_length_exceeded"


async def test_engine_threads_follow_the_core_share(engine, collect) -> None:
    """With the gateway's core share the engine's thread runs on every core between images and
    gives the encoder's back while an encoder batch runs, switching between steps."""
    from gateway.server.core_share import CoreShare

    share = CoreShare(cores=2, encoder_threads=1)
    seen: list[int] = []

    def threads_now() -> int:
        seen.append(torch.get_num_threads())  # what the engine's thread runs with now
        return share.engine_threads()

    twin = engine.replica(torch_threads=threads_now)
    await twin.start()
    try:
        await collect(twin, ask(QUESTION, 4))
        assert seen and seen[-1] == 2
        with share.encoding():
            await collect(twin, ask(QUESTION, 4))
            assert seen[-1] == 1
        await collect(twin, ask(QUESTION, 4))
        assert seen[-1] == 2
    finally:
        await twin.aclose()
