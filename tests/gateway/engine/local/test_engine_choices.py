"""n > 1 choices on the real model: one prefill, n streams, each its own sampler.

Choice i of a seeded request samples as a one-choice request with seed + i would, whether it
joined the batch at the fork or waited for a slot; the prompt is computed once; cancelling,
closing the stream, or a reader that stalls stops every choice.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.engine.interface import (
    GenerationRequest,
    GenerationResult,
    TextDelta,
)
from gateway.testing.engine_requests import text_requests

pytestmark = pytest.mark.slow

JOKE = "Tell me a joke about a cat."
STORY = "Write a long story about a dragon who lives in a castle."


# a salt of its own: prompts of other tests' files share no KV with these
ask = text_requests("choices", max_tokens=16, salt="choices")


async def run(engine, request: GenerationRequest) -> tuple[dict[int, str], list[GenerationResult]]:
    """Deltas joined per choice, and the results in the order they came."""
    texts: dict[int, str] = {}
    results: list[GenerationResult] = []
    async for item in engine.generate(request):
        if isinstance(item, TextDelta):
            assert not any(r.index == item.index for r in results), "a delta after its result"
            texts[item.index] = texts.get(item.index, "") + item.text
        else:
            results.append(item)
    return texts, results


async def test_three_choices_share_one_prefill(engine) -> None:
    sched = engine._scheduler
    before = sched.prefill_positions
    request = ask(JOKE, 16, salt="three", temperature=1.0, seed=40, n=3)
    texts, results = await run(engine, request)
    prefilled = sched.prefill_positions - before
    assert sorted(r.index for r in results) == [0, 1, 2]
    by_index = {r.index: r for r in results}
    for i, result in by_index.items():
        assert texts.get(i, "") == result.text
        assert result.input_tokens == results[0].input_tokens
        assert result.cached_tokens == results[0].cached_tokens == 0
        assert 0 < result.output_tokens <= 16
    assert prefilled == results[0].input_tokens  # the prompt once, not three times
    assert len({r.text for r in results}) > 1  # three samplers, not one
    # each choice is what a one-choice request with seed + i samples
    for i in range(3):
        _, (alone,) = await run(
            engine, ask(JOKE, 16, salt=f"alone-{i}", temperature=1.0, seed=40 + i)
        )
        assert alone.text == by_index[i].text
    # and the whole request again gives the same three
    _, again = await run(engine, ask(JOKE, 16, salt="three-again", temperature=1.0, seed=40, n=3))
    assert {r.index: r.text for r in again} == {i: r.text for i, r in by_index.items()}


async def test_greedy_choices_are_identical(engine) -> None:
    _, results = await run(engine, ask(JOKE, 12, n=2))
    assert len(results) == 2 and results[0].text == results[1].text
    assert results[0].output_tokens == results[1].output_tokens


async def test_choices_beyond_the_batch_wait_for_a_slot(engine) -> None:
    """max_batch 2, n = 4: two choices join at the fork, two wait and then run the same."""
    _, wide = await run(engine, ask(JOKE, 12, salt="wide", temperature=0.8, seed=5, n=4))
    twin = engine.replica(max_batch=2)
    await twin.start()
    try:
        _, narrow = await run(twin, ask(JOKE, 12, salt="narrow", temperature=0.8, seed=5, n=4))
    finally:
        await twin.aclose()
    assert {r.index: r.text for r in narrow} == {r.index: r.text for r in wide}
    assert all(r.input_tokens == narrow[0].input_tokens for r in narrow)


async def test_each_choice_obeys_the_grammar_and_reports_logprobs(engine) -> None:
    grammar = 'start: "{\\"answer\\": \\"" ("yes" | "no" | "maybe") "\\"}"'
    texts, results = await run(
        engine, ask("Will it rain?", 16, temperature=1.0, seed=2, n=3, grammar=grammar, logprobs=1)
    )
    assert len(results) == 3
    for result in results:
        assert json.loads(result.text)["answer"] in ("yes", "no", "maybe")
        assert result.finish_reason == "stop"
    # every choice's tokens come with its own deltas
    deltas: dict[int, bytes] = {}
    async for item in engine.generate(ask("Will it snow?", 16, n=2, grammar=grammar, logprobs=1)):
        if isinstance(item, TextDelta):
            deltas[item.index] = deltas.get(item.index, b"") + b"".join(
                t.bytes for t in item.logprobs
            )
        else:
            assert deltas[item.index] == item.text.encode()


async def test_cancel_stops_every_choice(engine) -> None:
    request = ask(STORY, 200, temperature=1.0, n=3)
    stream = engine.generate(request)
    seen: set[int] = set()
    results: list[GenerationResult] = []
    async for item in stream:
        if isinstance(item, TextDelta):
            seen.add(item.index)
            if len(seen) == 3:
                request.cancel.set()
        else:
            results.append(item)
    assert sorted(r.index for r in results) == [0, 1, 2]
    assert all(r.finish_reason == "cancelled" and r.output_tokens < 200 for r in results)
    assert engine.stats().running == 0


async def test_closing_the_stream_stops_every_choice(engine) -> None:
    stream = engine.generate(ask(STORY, 200, temperature=1.0, n=3))
    async for item in stream:
        if isinstance(item, TextDelta):
            break
    await stream.aclose()
    async with asyncio.timeout(60):
        while engine.stats().running:
            await asyncio.sleep(0.01)


async def test_cancel_before_the_fork_ends_each_choice(engine) -> None:
    request = ask(STORY, 8, n=3)
    request.cancel.set()
    _, results = await run(engine, request)
    assert sorted(r.index for r in results) == [0, 1, 2]
    assert all(r.finish_reason == "cancelled" for r in results)


async def test_a_stalled_reader_stops_every_choice(engine) -> None:
    cfg = engine._scheduler.cfg
    limit, cfg.max_unread_deltas = cfg.max_unread_deltas, 4
    try:
        stream = engine.generate(ask(STORY, 160, n=3))
        first = await anext(stream)
        assert isinstance(first, TextDelta)
        async with asyncio.timeout(60):
            while engine.stats().running:  # not reading now
                await asyncio.sleep(0.05)
        rest = [item async for item in stream]
    finally:
        cfg.max_unread_deltas = limit
    results = [r for r in rest if isinstance(r, GenerationResult)]
    assert sorted(r.index for r in results) == [0, 1, 2]
    assert all(r.finish_reason == "slow_reader" for r in results)
    assert len(rest) - 3 <= 3 * 4 + 3  # what was queued when they stopped, and no more
