"""Edges of the token limits an attacker leans on, on memory and a real redis-server: a window
that rolls over between a response's admission and its end (the estimate's correction belongs
to the admission's window, never to the next one's), counters that never go below zero, a
limit of one token, and the meter's count of a response that fails after it streamed."""

from __future__ import annotations

import time

import pytest

from gateway.policy.auth import Authenticator
from gateway.policy.key_store import (
    KeyRecord,
    MemoryKeyStore,
    new_key_id,
    new_secret,
    secret_digest,
)
from gateway.policy.key_usage import TokenMeter, TokenUsage
from gateway.policy.token_limits import (
    MemoryTokenLimiter,
    RedisTokenLimiter,
    TokenLimits,
    refusal,
)
from gateway.testing.clock import ManualClock

# 2026-12-03 13:00:50 UTC: 10 s left in the minute, the same UTC day for hours
LATE = 1796302850.0


async def test_a_correction_after_the_minute_rolled_over_stays_in_its_own_window(
    limiter_of,
) -> None:
    """An over-estimated response admitted at a minute's end and ending in the next minute:
    giving its estimate back there would wipe what the key used in the new minute (a way to
    reset one's own counter at will); only the budget, whose period it still is, is corrected."""
    clock = ManualClock(LATE)
    limiter = limiter_of(clock)
    limits = TokenLimits(input_tpm=1000, budget_tokens=10_000, budget_period="day")
    admitted = await limiter.admit("key_a", limits, 990)  # estimated high: really 10
    assert admitted.admitted
    clock.now += 15.0  # the next minute
    assert (await limiter.admit("key_a", limits, 900)).admitted  # the new minute's use
    await limiter.charge("key_a", limits, input=10 - 990, since=admitted.at)
    used = await limiter.admit("key_a", limits, 0)
    assert used.input == 900  # the new minute keeps what it used
    assert used.budget == 10 + 900  # the day's budget holds the real count
    # a correction within the admission's own minute still lands
    second = await limiter.admit("key_a", limits, 50)
    await limiter.charge("key_a", limits, input=-40, since=second.at)
    assert (await limiter.admit("key_a", limits, 0)).input == 910


async def test_counters_never_go_below_zero_and_a_limit_of_one(limiter_of) -> None:
    clock = ManualClock(LATE)
    limiter = limiter_of(clock)
    limits = TokenLimits(input_tpm=1, output_tpm=1)
    first = await limiter.admit("key_b", limits, 1)
    assert first.admitted
    assert not (await limiter.admit("key_b", limits, 1)).admitted  # the one token is used
    await limiter.charge("key_b", limits, input=-50, output=-50, since=first.at)
    used = await limiter.admit("key_b", limits, 0)
    assert (used.input, used.output, used.budget) == (0, 0, 0)
    assert used.admitted


async def managed(auth: Authenticator, store: MemoryKeyStore, **limits) -> str:
    secret = new_secret()
    record = KeyRecord(id=new_key_id(), name="n", created=time.time(), **limits)
    await store.create(record, secret_digest(secret))
    assert await auth.lookup(secret) == record
    return record.id


async def test_a_response_that_fails_after_streaming_keeps_its_cost() -> None:
    """The engine failed after 5 tokens went out: the failed end reports no usage, but the
    prompt was read and the tokens were sent, so neither is given back."""
    store, limiter = MemoryKeyStore(), MemoryTokenLimiter()
    auth = Authenticator([], store)
    meter = TokenMeter(limiter, auth)
    key = await managed(auth, store, input_tpm=1000, output_tpm=1000)
    limits = TokenLimits(input_tpm=1000, output_tpm=1000)
    metered = meter.open(key)
    assert await metered.admit(40) is None
    metered.streamed(5)
    metered.finish(TokenUsage())  # a failed end: no counts from the engine
    await meter._background.settled(key)
    used = await limiter.admit(key, limits, 0)
    assert (used.input, used.output) == (40, 5)
    (usage,) = await store.usage([key])
    assert (usage.input_tokens, usage.output_tokens) == (40, 5)
    # one refused before anything ran gives its estimate back
    refused = meter.open(key)
    assert await refused.admit(30) is None
    refused.finish(TokenUsage())
    await meter._background.settled(key)
    assert (await limiter.admit(key, limits, 0)).input == 40
    await meter.aclose()


async def test_one_huge_response_a_minute_does_not_outrun_the_limit(limiter_of) -> None:
    """A key of 1,000 input tokens a minute sends one 200,000-token prompt at the start of
    each minute: each was let in (its window had room) and every new minute started empty, so
    the key got 200 times its limit. Now what a window admitted past its limit plus one more
    limit is owed by the windows after it, one limit a window."""
    clock = ManualClock(LATE + 10.0)  # the start of a minute
    limiter = limiter_of(clock)
    limits = TokenLimits(input_tpm=1000)
    first = await limiter.admit("key_h", limits, 200_000)
    assert first.admitted
    await limiter.charge("key_h", limits, input=0, since=first.at)  # its estimate was right
    clock.now += 60.0
    refused = await limiter.admit("key_h", limits, 10)
    assert not refused.admitted and refused.input == 200_000 - 2000
    # Retry-After names when it is let in again, not the minute's end
    assert refusal(limits, refused).retry_after_s == pytest.approx(60.0 * 198)  # at 200 minutes on
    clock.now += 60.0 * 150
    assert not (await limiter.admit("key_h", limits, 10)).admitted
    clock.now += 60.0 * 50  # 200 minutes on: paid
    assert (await limiter.admit("key_h", limits, 10)).admitted
    # an ordinary overshoot (the limit plus one response) is not carried
    clock.now += 60.0
    assert (await limiter.admit("key_h", limits, 900)).admitted
    assert (await limiter.admit("key_h", limits, 900)).admitted
    clock.now += 60.0
    assert (await limiter.admit("key_h", limits, 1)).input == 1


async def test_an_estimate_corrected_after_its_minute_lowers_the_debt(limiter_of) -> None:
    clock = ManualClock(LATE + 10.0)
    limiter = limiter_of(clock)
    limits = TokenLimits(input_tpm=1000, budget_tokens=10**9, budget_period="month")
    big = await limiter.admit("key_d", limits, 50_000)  # really 5,000
    clock.now += 60.0  # it ends in the next minute, nothing written since
    await limiter.charge("key_d", limits, input=5_000 - 50_000, since=big.at)
    used = await limiter.admit("key_d", limits, 0)
    assert used.input == 5_000 - 2000 and used.budget == 5_000
    # a window opened (written) since: a late correction takes off its debt, never its own use
    again = await limiter.admit("key_e", limits, 20_000)  # really 2,000
    clock.now += 60.0
    await limiter.charge("key_e", limits, output=1)  # the new minute is written
    await limiter.charge("key_e", limits, input=2_000 - 20_000, since=again.at)
    assert (await limiter.admit("key_e", limits, 0)).input == 0


async def test_token_charges_past_the_writes_in_flight_are_owed_not_dropped(monkeypatch) -> None:
    """With as many writes in flight as the meter allows (a slow Redis, a flood of streams),
    a token charge was dropped: tokens streamed for free. Now it is owed, and the key's next
    charge writes it (a correction that lowers a count may be dropped: never fewer counted)."""
    import gateway.policy.key_usage as key_usage

    monkeypatch.setattr(key_usage, "MAX_PENDING", 1)
    store, limiter = MemoryKeyStore(), MemoryTokenLimiter()
    auth = Authenticator([], store)
    meter = TokenMeter(limiter, auth)
    key = await managed(auth, store, output_tpm=10_000)
    limits = TokenLimits(output_tpm=10_000)
    meter.charge(key, limits, input=0, output=16)  # takes the one slot
    meter.charge(key, limits, input=0, output=16)  # no slot: owed
    meter.charge(key, limits, input=-5, output=16)  # no slot: owed (its correction dropped)
    await meter._background.settled(key)
    assert (await limiter.admit(key, limits, 0)).output == 16
    meter.charge(key, limits, input=0, output=1)  # a slot again: it carries what is owed
    await meter._background.settled(key)
    assert (await limiter.admit(key, limits, 0)).output == 16 * 3 + 1
    await meter.aclose()


async def test_what_is_owed_at_shutdown_is_written_before_the_limiter_closes(
    monkeypatch, redis_url
) -> None:
    """Charges owed when the process stops (no later charge of that key to carry them) were
    lost with it; `aclose` writes them, and another replica reads them on Redis."""
    import gateway.policy.key_usage as key_usage

    monkeypatch.setattr(key_usage, "MAX_PENDING", 1)
    store = MemoryKeyStore()
    auth = Authenticator([], store)
    meter = TokenMeter(RedisTokenLimiter(redis_url, namespace="owed-at-shutdown"), auth)
    key = await managed(auth, store, input_tpm=10_000, output_tpm=10_000)
    limits = TokenLimits(input_tpm=10_000, output_tpm=10_000)
    meter.charge(key, limits, input=0, output=16)  # takes the one slot
    meter.charge(key, limits, input=7, output=16)  # no slot: owed
    meter.charge(key, limits, input=0, output=5)  # no slot: owed
    await meter.aclose()
    other = RedisTokenLimiter(redis_url, namespace="owed-at-shutdown")
    try:
        used = await other.admit(key, limits, 0)
        assert (used.input, used.output) == (7, 16 * 2 + 5)
    finally:
        await other.aclose()
