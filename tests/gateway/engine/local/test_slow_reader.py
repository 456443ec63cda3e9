"""A caller that stops taking deltas stops generation for it (the real engine)."""

from __future__ import annotations

import asyncio
import time

from gateway.engine.interface import (
    GenerationRequest,
    GenerationResult,
    Message,
    SamplingParams,
    TextDelta,
)

PROMPT = "Count from one to one hundred in words, separated by commas."


def request(rid: str) -> GenerationRequest:
    return GenerationRequest(
        rid, [Message("user", [PROMPT])], SamplingParams(max_output_tokens=160)
    )


async def test_a_caller_that_stops_reading_stops_generation(engine, collect) -> None:
    cfg = engine._scheduler.cfg
    limit, cfg.max_unread_deltas = cfg.max_unread_deltas, 6
    try:
        # a reader that keeps up is not cut, whatever the limit
        deltas, steady = await collect(engine, request("steady"))
        assert steady.finish_reason in ("stop", "length") and steady.output_tokens > 12
        stream = engine.generate(request("stalled"))
        first = await stream.__anext__()
        assert isinstance(first, TextDelta)
        deadline = time.monotonic() + 60
        while engine.stats().running and time.monotonic() < deadline:  # not reading now
            await asyncio.sleep(0.05)
        assert engine.stats().running == 0, "generation ran on for a caller that is not reading"
        rest = [item async for item in stream]
    finally:
        cfg.max_unread_deltas = limit
    result = rest[-1]
    assert isinstance(result, GenerationResult) and result.finish_reason == "slow_reader"
    assert len(rest) - 1 <= 6 + 2  # what was queued when it stopped, and no more
    assert result.output_tokens < steady.output_tokens
    assert "".join(d.text for d in [first, *rest[:-1]]) == "".join(deltas)[: len(result.text)]
