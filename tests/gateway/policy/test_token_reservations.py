"""Output reservations, slots of responses in flight and long debts of the token limiters, on
memory, a real redis-server and a real Redis Cluster: a burst of concurrent admissions gets
one response past a limit, its reservation included, never more; what a response did not use
is given back (once); a key's cap on responses in flight holds, frees on release or when a
lease runs out; a debt of many days is still owed after a day, and on Redis the hash lives as
long as the debt."""

from __future__ import annotations

import asyncio
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
    LIVE_LEASE_S,
    MemoryTokenLimiter,
    RedisTokenLimiter,
    TokenLimits,
    refusal,
)
from gateway.testing.clock import ManualClock

# 2026-12-03 13:00:10 UTC: 50 s left in the minute, the same UTC day for hours
EARLY = 1796302810.0


async def test_a_burst_of_reservations_gets_one_response_past_the_limit(limiter_of) -> None:
    """20 concurrent admissions, each reserving 100 output tokens, on a key of 100 output
    tokens a minute: the first takes the room with its whole reservation, the others find
    none (only the input used to count at admission: all 20 were let in)."""
    clock = ManualClock(EARLY)
    limiter = limiter_of(clock)
    limits = TokenLimits(output_tpm=100)
    burst = await asyncio.gather(
        *(limiter.admit("key_r", limits, 5, output=100) for _ in range(20))
    )
    assert sum(u.admitted for u in burst) == 1
    refused = next(u for u in burst if not u.admitted)
    assert refused.output == 100 and not refused.busy
    assert refusal(limits, refused).code == "rate_limited"


async def test_a_budget_burst_reserves_input_and_output(limiter_of) -> None:
    """30 concurrent admissions of max_tokens=1000 against a budget of 1,000 tokens a day:
    one is let in, and the budget holds its input and its whole reservation."""
    clock = ManualClock(EARLY)
    limiter = limiter_of(clock)
    limits = TokenLimits(budget_tokens=1000, budget_period="day")
    burst = await asyncio.gather(
        *(limiter.admit("key_b", limits, 8, output=1000) for _ in range(30))
    )
    assert sum(u.admitted for u in burst) == 1
    assert (await limiter.admit("key_b", limits, 0)).budget == 1008


async def test_the_unused_reservation_is_given_back_in_the_admissions_windows(limiter_of) -> None:
    clock = ManualClock(EARLY)
    limiter = limiter_of(clock)
    limits = TokenLimits(output_tpm=100, budget_tokens=10_000, budget_period="day")
    first = await limiter.admit("key_g", limits, 5, output=100)
    assert first.admitted and first.output == 100
    assert not (await limiter.admit("key_g", limits, 5, output=100)).admitted
    # a short answer: 7 of the 100 written, its input really 4
    await limiter.charge("key_g", limits, input=4 - 5, output=7 - 100, since=first.at)
    used = await limiter.admit("key_g", limits, 0)
    assert (used.input, used.output, used.budget) == (4, 7, 11)
    assert (await limiter.admit("key_g", limits, 5, output=100)).admitted


async def test_a_reservation_given_back_after_its_minute_leaves_the_new_minute_alone(
    limiter_of,
) -> None:
    """Admitted at a minute's end with 250 reserved against 100 a minute, it ends in the next
    minute after 10 tokens, once another response took that minute's room: the give-back
    takes off the debt the old minute left, never the new response's own reservation."""
    clock = ManualClock(EARLY + 45.0)
    limiter = limiter_of(clock)
    limits = TokenLimits(output_tpm=100)
    first = await limiter.admit("key_m", limits, 1, output=250)
    clock.now += 20.0  # the next minute: it owes 250 - 2 * 100 = 50
    second = await limiter.admit("key_m", limits, 1, output=60)
    assert second.admitted and second.output == 50 + 60
    await limiter.charge("key_m", limits, output=10 - 250, since=first.at)
    assert (await limiter.admit("key_m", limits, 0)).output == 60


async def test_the_cap_on_responses_in_flight(limiter_of) -> None:
    clock = ManualClock(EARLY)
    limiter = limiter_of(clock)
    limits = TokenLimits()
    taken = [await limiter.admit("key_c", limits, 0, response=f"r{i}", concurrency=2) for i in "01"]
    assert all(u.admitted for u in taken) and taken[-1].live == 2
    third = await limiter.admit("key_c", limits, 0, response="r2", concurrency=2)
    assert not third.admitted and third.busy and third.live == 2
    await limiter.charge("key_c", limits, release="r0")
    await limiter.charge("key_c", limits, release="r0")  # twice: the second frees nothing
    assert (await limiter.admit("key_c", limits, 0, response="r3", concurrency=2)).admitted
    assert not (await limiter.admit("key_c", limits, 0, response="r4", concurrency=2)).admitted
    # another key has its own slots
    assert (await limiter.admit("key_z", limits, 0, response="r0", concurrency=2)).admitted
    # a slot whose replica died frees itself when its lease runs out; a renewed one does not
    clock.now += LIVE_LEASE_S - 10.0
    await limiter.renew("key_c", "r3")
    clock.now += 11.0  # r1's lease is over, r3's renewed one is not
    assert (await limiter.admit("key_c", limits, 0, response="r5", concurrency=2)).admitted
    assert not (await limiter.admit("key_c", limits, 0, response="r6", concurrency=2)).admitted


async def test_a_burst_under_a_cap_takes_no_more_slots_than_the_cap(limiter_of) -> None:
    limiter = limiter_of(ManualClock(EARLY))
    limits = TokenLimits(input_tpm=10**9)
    burst = await asyncio.gather(
        *(limiter.admit("key_k", limits, 3, response=f"r{i}", concurrency=4) for i in range(40))
    )
    assert sum(u.admitted for u in burst) == 4
    assert all(u.busy for u in burst if not u.admitted)
    # the refused ones counted nothing
    assert (await limiter.admit("key_k", limits, 0)).input == 4 * 3


async def test_a_debt_of_many_days_is_still_owed_after_a_day(limiter_of) -> None:
    """30,000 tokens admitted at once against 1,000 a day: the days after it owe 29,000 less
    a day's limit each, so a day later the key is still refused, and on Redis the counters'
    hash lives until the last owed day has ended (it expired after about a day: the burst
    could repeat daily)."""
    clock = ManualClock(EARLY)
    limiter = limiter_of(clock)
    limits = TokenLimits(budget_tokens=1000, budget_period="day")
    assert (await limiter.admit("key_d", limits, 30, output=30_000 - 30)).admitted
    clock.now += 86400.0
    later = await limiter.admit("key_d", limits, 10, output=10)
    assert not later.admitted and later.budget == 30_000 - 2000
    retry = refusal(limits, later).retry_after_s
    assert retry > 27 * 86400.0
    if isinstance(limiter, RedisTokenLimiter):
        ttl = await limiter._redis.ttl(limiter.key("key_d"))
        assert ttl > 28 * 86400, ttl
    clock.now += 29 * 86400.0  # every owed day over: let in again
    assert (await limiter.admit("key_d", limits, 10, output=10)).admitted


async def test_a_minute_debt_keeps_the_hash_for_its_minutes(redis_url) -> None:
    limiter = RedisTokenLimiter(redis_url, namespace="minute-debt")
    try:
        limits = TokenLimits(output_tpm=100)
        assert (await limiter.admit("key_t", limits, 1, output=100 * 300)).admitted
        ttl = await limiter._redis.ttl(limiter.key("key_t"))
        assert 298 * 60 <= ttl <= 301 * 60 + 60, ttl
        # an ordinary minute's use keeps it for that minute only
        assert (await limiter.admit("key_u", limits, 1, output=50)).admitted
        assert 0 < await limiter._redis.ttl(limiter.key("key_u")) <= 120
    finally:
        await limiter.aclose()


async def managed(auth: Authenticator, store: MemoryKeyStore, **fields) -> str:
    secret = new_secret()
    record = KeyRecord(id=new_key_id(), name="n", created=time.time(), **fields)
    await store.create(record, secret_digest(secret))
    assert await auth.lookup(secret) == record
    return record.id


@pytest.fixture
async def meter_and_key():
    store, limiter = MemoryKeyStore(), MemoryTokenLimiter()
    auth = Authenticator([], store)
    meter = TokenMeter(limiter, auth, concurrency=3)
    key = await managed(auth, store, output_tpm=100, budget_tokens=10_000, budget_period="day")
    yield meter, limiter, key
    await meter.aclose()


async def test_a_response_gives_back_its_unused_reservation_once(meter_and_key) -> None:
    meter, limiter, key = meter_and_key
    limits = meter.limits(key)
    first = meter.open(key)
    assert await first.admit(10, 100) is None
    refused = meter.open(key)
    error = await refused.admit(10, 100)  # the reservation took the minute's room
    assert error is not None and error.code == "rate_limited"
    for _ in range(5):
        first.streamed(1)
    first.finish(TokenUsage(input_tokens=8, output_tokens=5))
    first.finish(TokenUsage(input_tokens=8, output_tokens=5))
    first.close()
    await meter._background.settled(key)
    used = await limiter.admit(key, limits, 0)
    assert (used.input, used.output, used.budget) == (8, 5, 13)
    (usage,) = await meter.auth.store.usage([key])
    assert (usage.input_tokens, usage.output_tokens) == (8, 5)  # recorded once
    assert await meter.open(key).admit(10, 90) is None


async def test_a_response_that_never_finished_counts_what_streamed(meter_and_key) -> None:
    """A client gone or a cancel: `close` without a `finish` keeps the estimate and the tokens
    streamed, and gives back the rest of the reservation and the slot."""
    meter, limiter, key = meter_and_key
    metered = meter.open(key)
    assert await metered.admit(10, 100) is None
    for _ in range(3):
        metered.streamed(1)
    metered.close()
    metered.close()
    await meter._background.settled(key)
    used = await limiter.admit(key, meter.limits(key), 0)
    assert (used.input, used.output) == (10, 3)
    assert not limiter._live.get(key)


async def test_output_past_a_reservation_is_counted_as_it_streams(meter_and_key) -> None:
    """Admitted with no reservation (as while the counters could not be read): what streams
    is counted every 16 tokens, and the end counts the rest."""
    meter, limiter, key = meter_and_key
    metered = meter.open(key)
    assert await metered.admit(10, 0) is None
    for _ in range(40):
        metered.streamed(1)
    await meter._background.settled(key)
    assert (await limiter.admit(key, meter.limits(key), 0)).output == 32
    metered.finish(TokenUsage(input_tokens=10, output_tokens=40))
    await meter._background.settled(key)
    assert (await limiter.admit(key, meter.limits(key), 0)).output == 40


async def test_the_meter_refuses_past_the_cap_and_a_keys_own_cap_wins() -> None:
    store, limiter = MemoryKeyStore(), MemoryTokenLimiter()
    auth = Authenticator([], store)
    meter = TokenMeter(limiter, auth, concurrency=2)
    plain = await managed(auth, store)  # no token limits: only the cap
    own = await managed(auth, store, max_concurrent=3)
    try:
        for key, cap in ((plain, 2), (own, 3)):
            open_ = [meter.open(key) for _ in range(cap)]
            assert [await m.admit(5, 10) for m in open_] == [None] * cap
            error = await meter.open(key).admit(5, 10)
            assert error is not None and error.code == "concurrency_limited"
            assert error.http_status == 429 and error.retry_after_s >= 1
            open_[0].finish(TokenUsage(input_tokens=5, output_tokens=1))
            await meter._background.settled(key)
            assert await meter.open(key).admit(5, 10) is None
        assert meter.cap("anonymous") == 0  # no key, no cap
    finally:
        await meter.aclose()


async def test_a_slot_whose_release_found_no_room_is_given_back_with_the_next_charge(
    monkeypatch,
) -> None:
    """With as many writes in flight as the meter allows, the charge that ends a response was
    owed but its slot was dropped: under a flood a key's slots leaked until their leases ran
    out. Now the slot is owed too, and the key's next charge gives it back."""
    import gateway.policy.key_usage as key_usage

    monkeypatch.setattr(key_usage, "MAX_PENDING", 1)
    store, limiter = MemoryKeyStore(), MemoryTokenLimiter()
    auth = Authenticator([], store)
    meter = TokenMeter(limiter, auth, concurrency=1)
    key = await managed(auth, store, output_tpm=10_000)
    try:
        metered = meter.open(key)
        assert await metered.admit(5, 10) is None
        meter.charge(key, meter.limits(key), input=0, output=1)  # takes the one slot in flight
        metered.finish(TokenUsage(input_tokens=5, output_tokens=2))  # its write is owed
        await meter._background.settled(key)
        assert limiter._live[key]  # still held
        meter.charge(key, meter.limits(key), input=0, output=1)
        await meter._background.settled(key)
        assert not limiter._live[key]
    finally:
        await meter.aclose()


class CancelledOnTheWayBack(MemoryTokenLimiter):
    """A real in-memory limiter whose admission is counted and then cancelled before its
    answer reaches the caller, as a Redis script that ran while its caller was cancelled."""

    async def admit(self, *args, **kwargs):
        await super().admit(*args, **kwargs)
        raise asyncio.CancelledError


async def test_a_response_cancelled_during_its_admission_frees_its_slot() -> None:
    from gateway.chat.metering import admitted

    store, limiter = MemoryKeyStore(), CancelledOnTheWayBack()
    auth = Authenticator([], store)
    meter = TokenMeter(limiter, auth, concurrency=1)
    key = await managed(auth, store)
    try:
        with pytest.raises(asyncio.CancelledError):
            await admitted(meter, key, 5, None, 0.0, None, 10)  # type: ignore[arg-type]
        await meter._background.settled(key)
        assert not limiter._live[key]
    finally:
        await meter.aclose()


@pytest.mark.parametrize("reserved", [150, 250, 300, 1000])
async def test_retry_after_names_the_first_window_that_lets_a_response_in(
    limiter_of, reserved
) -> None:
    """A reservation of `reserved` output tokens against 100 a minute, used in full: the
    refusals' Retry-After, read in its own minute and in each later one, is when the key is
    let in again (it named a window too late once a window held two limits or more)."""
    clock = ManualClock(EARLY - 10.0)  # a minute's start
    limiter = limiter_of(clock)
    limits = TokenLimits(output_tpm=100)
    assert (await limiter.admit("key_w", limits, 0, output=reserved)).admitted
    let_in = None
    while True:
        used = await limiter.admit("key_w", limits, 0)
        if used.admitted:
            break
        retry = refusal(limits, used).retry_after_s
        assert let_in is None or clock.now + retry == pytest.approx(let_in)
        let_in = clock.now + retry
        clock.now += 60.0
    assert clock.now == pytest.approx(let_in)
