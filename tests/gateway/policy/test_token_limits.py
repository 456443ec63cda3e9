"""Token limits on memory, a real redis-server and a real Redis Cluster: admission while there
is room (counting the estimate in the same step), the three windows, corrections, concurrent
replicas held to the limit plus one response, a Redis that does not answer, and the header
formats."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from gateway.policy.rate_headers import Allowance, RateLimitNote, duration
from gateway.policy.token_limits import (
    MemoryTokenLimiter,
    RedisTokenLimiter,
    TokenLimits,
    refusal,
    windows,
)
from gateway.testing.clock import ManualClock
from gateway.testing.ports import free_port

# 2026-12-03 13:00:10 UTC: 50 s left in the minute, 10 h 59 m 50 s in the day
NOON = 1796302810.0


async def test_room_then_refusal_then_the_next_minute(limiter_of) -> None:
    clock = ManualClock(NOON)
    limiter = limiter_of(clock)
    limits = TokenLimits(input_tpm=100)
    first = await limiter.admit("key_a", limits, 60)
    assert first.admitted and first.input == 60
    # room left (60 < 100): admitted, and its whole estimate counted (the "plus one")
    second = await limiter.admit("key_a", limits, 60)
    assert second.admitted and second.input == 120
    third = await limiter.admit("key_a", limits, 1)
    assert not third.admitted and third.input == 120  # nothing counted for a refusal
    error = refusal(limits, third)
    assert error.code == "rate_limited" and error.http_status == 429
    assert "100 input tokens per minute" in error.message
    assert error.retry_after_s == pytest.approx(50.0)
    # another key is not touched
    assert (await limiter.admit("key_b", limits, 5)).input == 5
    clock.now += 50.0  # the next minute
    assert (await limiter.admit("key_a", limits, 1)).input == 1


async def test_output_and_budget_windows_and_corrections(limiter_of) -> None:
    clock = ManualClock(NOON)
    limiter = limiter_of(clock)
    limits = TokenLimits(output_tpm=50, budget_tokens=300, budget_period="day")
    assert (await limiter.admit("key_a", limits, 40)).admitted
    await limiter.charge("key_a", limits, input=-30, output=50)  # estimate was 30 too high
    used = await limiter.admit("key_a", limits, 0)
    assert (used.input, used.output, used.budget) == (10, 50, 60)
    assert not used.admitted and used.refused_by(limits) == ["output_tpm"]
    clock.now += 60.0  # output room again; the day's budget keeps counting
    used = await limiter.admit("key_a", limits, 250)
    assert used.admitted and (used.input, used.output, used.budget) == (250, 0, 310)
    refused = await limiter.admit("key_a", limits, 1)
    assert refused.refused_by(limits) == ["budget"]
    error = refusal(limits, refused)
    assert "300 tokens per day" in error.message
    assert error.retry_after_s == pytest.approx(10 * 3600 + 58 * 60 + 50)
    clock.now += 11 * 3600  # the next UTC day
    assert (await limiter.admit("key_a", limits, 1)).budget == 1
    # no counter goes below zero
    await limiter.charge("key_a", limits, input=-1000)
    assert (await limiter.admit("key_a", limits, 0)).input == 0


def test_windows_and_the_tightest_limit() -> None:
    minute, period, m_reset, p_reset = windows(TokenLimits(budget_period="month"), NOON)
    assert minute == str(int(NOON // 60)) and period == "m202612"
    assert m_reset == pytest.approx(50.0)
    assert p_reset == pytest.approx(28 * 86400 + 10 * 3600 + 59 * 60 + 50)
    assert windows(TokenLimits(input_tpm=1), NOON)[1] == ""
    from gateway.policy.token_limits import Used

    limits = TokenLimits(input_tpm=1000, output_tpm=100, budget_tokens=5000, budget_period="day")
    used = Used(200, 90, 4000, 50.0, 3600.0)
    assert used.tightest(limits) == Allowance(100, 10, 50.0)  # output: 10 left
    assert Used(200, 0, 4995, 50.0, 3600.0).tightest(limits) == Allowance(5000, 5, 3600.0)


async def test_two_replicas_under_concurrent_clients_hold_the_limit(limiter_of) -> None:
    """Two limiters on one Redis (two gateway replicas), 40 clients at once, each response
    estimated at 7 tokens against 100 a minute: exactly ceil(100 / 7) = 15 get in, so the
    tokens admitted stay under the limit plus one response."""
    clock = ManualClock(NOON)
    a, b = limiter_of(clock), limiter_of(clock)
    limits = TokenLimits(input_tpm=100)
    results = await asyncio.gather(
        *((a if i % 2 else b).admit("key_c", limits, 7) for i in range(40))
    )
    admitted = [u for u in results if u.admitted]
    expected = math.ceil(100 / 7)
    if isinstance(a, MemoryTokenLimiter):  # two in-process limiters share nothing
        assert len(admitted) == 2 * expected
        return
    assert len(admitted) == expected
    assert 7 * len(admitted) < 100 + 7
    assert max(u.input for u in admitted) == 7 * expected


async def test_redis_that_does_not_answer_lets_through() -> None:
    limiter = RedisTokenLimiter(f"redis://127.0.0.1:{free_port()}/0")
    try:
        t0 = time.monotonic()
        assert await limiter.admit("key_a", TokenLimits(input_tpm=1), 5) is None
        await limiter.charge("key_a", TokenLimits(input_tpm=1), output=5)  # lost, logged
        assert time.monotonic() - t0 < 6
    finally:
        await limiter.aclose()


def test_limits_of_a_record() -> None:
    from gateway.policy.key_store import KeyRecord

    base = dict(id="key_" + "0" * 24, name="n", created=0.0)
    assert TokenLimits.of(KeyRecord(**base, rpm=5)) is None
    assert TokenLimits.of(None) is None
    got = TokenLimits.of(KeyRecord(**base, input_tpm=9, budget_tokens=10, budget_period="month"))
    assert got == TokenLimits(input_tpm=9, budget_tokens=10, budget_period="month")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0ms"),
        (0.0201, "21ms"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (59.9999, "1m0s"),
        (360.0, "6m0s"),
        (3725.25, "1h2m5.25s"),
    ],
)
def test_durations_as_openai_writes_them(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_note_headers() -> None:
    note = RateLimitNote()
    assert note.headers() == []
    note.requests = Allowance(60, 59, 1.0)
    note.tokens = Allowance(1000, 0, 360.0)
    assert dict(note.headers()) == {
        b"x-ratelimit-limit-requests": b"60",
        b"x-ratelimit-remaining-requests": b"59",
        b"x-ratelimit-reset-requests": b"1s",
        b"x-ratelimit-limit-tokens": b"1000",
        b"x-ratelimit-remaining-tokens": b"0",
        b"x-ratelimit-reset-tokens": b"6m0s",
    }
