"""KV warm-up on the real model: exact, lowest priority, first to go under KV pressure.

A warm-up prefills a session's prompt through its latest message (or part) into the prefix
cache before the next turn's request exists; the request then prefills only what follows. The
answer must be the one a cold engine gives. The step plans the scheduler builds are recorded
(`_plan` wrapped on a replica of the shared engine) to check what warm-ups are given beside
other sessions' work; nothing is timed.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from gateway.engine.interface import GenerationRequest, ImageInput, Message, SamplingParams
from gateway.engine.local.prompt import render
from gateway.engine.local.step_plan import WARMUP_BESIDE_DIVISOR

pytestmark = pytest.mark.slow

SYSTEM = Message("system", ["You describe pictures in one short sentence."])
QUESTION = "What is in this picture?"


def image(engine, seed: int, n: int = 40) -> ImageInput:
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(n, engine.hidden_size, generator=g)  # [N, H]
    embeds = embeds / embeds.pow(2).mean(dim=-1, keepdim=True).sqrt() * engine.embedding_rms
    return ImageInput(digest=f"img{seed}", embeds=embeds)


def request(
    messages: list[Message],
    session: str | None,
    *,
    max_tokens: int = 16,
    salt: str | None = None,
    warm_up: str | None = None,
    owner: str | None = None,
) -> GenerationRequest:
    return GenerationRequest(
        f"r-{uuid.uuid4().hex[:6]}",
        messages,
        SamplingParams(max_output_tokens=max_tokens),
        kv_key=session,
        cache_salt=salt or session or uuid.uuid4().hex,
        owner=owner,
        warm_up=warm_up,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("mode", ["message", "part"])
async def test_warmed_turn_answers_as_a_cold_one(engine, collect, mode: str) -> None:
    """Realtime items ("message": the question is a message of its own) and HTTP turns
    ("part": the question follows the photo in the same message)."""
    session = f"warm-{mode}"
    photo = image(engine, 1)
    if mode == "message":
        ahead = [SYSTEM, Message("user", [photo])]
        turn = [*ahead, Message("user", [QUESTION])]
    else:
        ahead = [SYSTEM, Message("user", [photo])]
        turn = [SYSTEM, Message("user", [photo, QUESTION])]
    warmed = await engine.warm_up(request(ahead, session, warm_up=mode))
    assert warmed.outcome == "warmed", warmed
    prefix = render(
        engine.tokenizer, ahead, add_generation_prompt=False, open_last=mode == "part"
    ).length
    assert warmed.positions == prefix and warmed.computed == prefix
    _, hot = await collect(engine, request(turn, session))
    _, cold = await collect(engine, request(turn, None))
    assert cold.cached_tokens == 0 and cold.warmed_tokens == 0
    assert hot.text == cold.text and hot.output_tokens == cold.output_tokens
    assert hot.input_tokens == cold.input_tokens
    # all that the warm-up computed is reused, and only the question's positions are new
    # (the last one or two of the prefix may be tokenized together with what follows)
    assert prefix - 2 <= hot.cached_tokens <= prefix
    assert hot.warmed_tokens == hot.cached_tokens
    assert hot.cached_image_tokens == photo.num_tokens


async def test_warm_up_after_a_turn_computes_only_the_new_item(engine, collect) -> None:
    """Turn 2's photo is warmed on top of turn 1's KV; the follow-up is exact too."""
    session = "warm-second-turn"
    first = [SYSTEM, Message("user", ["Hello! I will send you photos."])]
    _, turn1 = await collect(engine, request(first, session))
    ahead = [*first, Message("assistant", [turn1.text]), Message("user", [image(engine, 2)])]
    warmed = await engine.warm_up(request(ahead, session))
    assert warmed.outcome == "warmed"
    assert 0 < warmed.computed < warmed.positions  # turn 1's KV was reused
    turn = [*ahead, Message("user", [QUESTION])]
    _, hot = await collect(engine, request(turn, session))
    _, cold = await collect(engine, request(turn, None))
    assert hot.text == cold.text
    assert hot.warmed_tokens >= warmed.computed - 2


def _recording(sched) -> list[list[tuple[str, bool, int, int]]]:
    """Wrap the scheduler's planner: each step's (request id, warm-up, start, positions)."""
    steps: list[list[tuple[str, bool, int, int]]] = []
    plan = sched._plan

    def recorded():
        out = plan()
        steps.append([(s.request.request_id, s.warm, start, n) for s, start, n in out])
        return out

    sched._plan = recorded
    return steps


async def test_warm_up_never_takes_a_decode_or_first_token_step(engine, collect) -> None:
    """Beside another session's decodes a warm-up feeds a small slice a step, and none while a
    request's prompt is being prefilled; the decode is in every step it runs."""
    twin = engine.replica(max_batch=4, prefill_chunk_tokens=128)
    await twin.start()
    try:
        sched = twin._scheduler
        steps = _recording(sched)
        beside = 128 // WARMUP_BESIDE_DIVISOR
        talk = request(
            [Message("user", ["Write a long story about a dragon who learns to sing."])],
            "talker",
            max_tokens=40,
            owner="a",
        )
        started = asyncio.Event()

        async def run_talker():
            result = None
            async for item in twin.generate(talk):
                started.set()
                result = item
            return result

        talker = asyncio.create_task(run_talker())
        await started.wait()
        ahead = [SYSTEM, Message("user", [image(engine, 3, n=300)])]
        warm = asyncio.create_task(twin.warm_up(request(ahead, "viewer", owner="b")))
        await asyncio.sleep(0.3)
        question = request(
            [SYSTEM, Message("user", ["Describe a beach in two sentences."])], "other", owner="c"
        )
        _, asked = await collect(twin, question)
        talked = await talker
        warmed = await warm
        assert warmed.outcome == "warmed" and talked.output_tokens > 8
        talking = [i for i, step in enumerate(steps) if any(e[0] == talk.request_id for e in step)]
        # the decode is in every step from its first to its last: never held for a warm-up
        assert talking == list(range(talking[0], talking[-1] + 1))
        for i, step in enumerate(steps):
            warm_n = sum(n for _, w, _, n in step if w)
            if any(not w and n > 1 for _, w, _, n in step):  # a prompt being prefilled
                assert warm_n == 0, step
            if i in talking:
                assert warm_n <= beside, step
        # the question was prefilled as fast as alone: one step for its whole prompt
        assert asked.prefill_chunks == 1
        # the warm-up did run beside the decode (and took more of the idle steps)
        assert any(any(e[1] for e in steps[i]) for i in talking)
    finally:
        await twin.aclose()


async def test_kv_pressure_drops_warm_ups_first(engine, collect) -> None:
    """A request that needs the memory takes a warm-up's pin before any session's pin."""
    pos = engine._scheduler.kv.pos_bytes
    kept = [SYSTEM, Message("user", ["Name three rivers of Europe."])]
    kept_len = render(engine.tokenizer, kept, add_generation_prompt=True).length
    ahead = [SYSTEM, Message("user", [image(engine, 4, n=200)])]
    big = [Message("user", ["Tell me about the sea. " * 40])]
    big_len = render(engine.tokenizer, big, add_generation_prompt=True).length
    # room for the kept session's turn and the big request, not for the warm-up beside them
    budget = pos * (kept_len + 16 + 64 + big_len + 64 + 2 * 64)
    twin = engine.replica(kv_budget_bytes=budget)
    await twin.start()
    try:
        sched = twin._scheduler
        _, turn1 = await collect(twin, request(kept, "kept", max_tokens=8))
        warmed = await twin.warm_up(request(ahead, "viewer"))
        assert warmed.outcome == "warmed"
        await asyncio.to_thread(sched.barrier, 30.0)
        assert sched.kv.warm_sessions == 1 and sched.kv.pinned_sessions == 1
        _, answer = await collect(twin, request(big, "big", max_tokens=4))
        assert answer.preemptions == 0
        await asyncio.to_thread(sched.barrier, 30.0)
        assert sched.kv.warm_sessions == 0  # the warm-up's pin went
        assert sched.kv.pinned("kept")  # the kept session's did not
        again = [*kept, Message("assistant", [turn1.text]), Message("user", ["And of Asia?"])]
        _, turn2 = await collect(twin, request(again, "kept", max_tokens=4))
        assert turn2.cached_tokens >= kept_len
        # a warm-up that cannot fit beside the pins is dropped, not admitted at their cost
        huge = [SYSTEM, Message("user", [image(engine, 5, n=budget // pos)])]
        dropped = await twin.warm_up(request(huge, "huge"))
        assert dropped.outcome == "dropped" and dropped.reason == "kv_pressure"
        assert sched.kv.pinned("kept")
    finally:
        await twin.aclose()


async def test_no_warm_up_without_prefix_caching(engine) -> None:
    twin = engine.replica(prefix_caching=False)
    await twin.start()
    try:
        ahead = [SYSTEM, Message("user", [image(engine, 6)])]
        before = twin._scheduler.prefill_positions
        result = await twin.warm_up(request(ahead, "uncached"))
        assert result.outcome == "dropped" and result.positions == 0
        assert twin._scheduler.prefill_positions == before  # nothing was computed for it
    finally:
        await twin.aclose()
