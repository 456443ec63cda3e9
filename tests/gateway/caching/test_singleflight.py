"""SingleFlight: one call per key in flight, shared by every concurrent caller."""

from __future__ import annotations

import asyncio

import pytest

from gateway.caching import SingleFlight


class Work:
    """A countable call that blocks until released."""

    def __init__(self, value: object = "tokens", error: Exception | None = None) -> None:
        self.value = value
        self.error = error
        self.calls = 0
        self.cancelled = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self) -> object:
        self.calls += 1
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.error is not None:
            raise self.error
        return self.value


async def test_concurrent_callers_share_one_call() -> None:
    flight: SingleFlight[str, object] = SingleFlight()
    work = Work()
    waiters = [asyncio.create_task(flight.do("d1", work)) for _ in range(8)]
    await work.started.wait()
    assert flight.in_flight("d1") and not flight.in_flight("d2") and len(flight) == 1
    work.release.set()
    assert await asyncio.gather(*waiters) == ["tokens"] * 8
    assert work.calls == 1
    assert not flight.in_flight("d1") and len(flight) == 0
    # Nothing is cached: the next call runs again.
    assert await flight.do("d1", work) == "tokens"
    assert work.calls == 2


async def test_failure_reaches_every_waiter_and_frees_the_key() -> None:
    flight: SingleFlight[str, object] = SingleFlight()
    boom = RuntimeError("encoder exploded")
    work = Work(error=boom)
    waiters = [asyncio.create_task(flight.do("d1", work)) for _ in range(8)]
    await work.started.wait()
    work.release.set()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(r is boom for r in results)
    assert work.calls == 1 and not flight.in_flight("d1")
    retry = Work(value="second try")
    retry.release.set()
    assert await flight.do("d1", retry) == "second try"


async def test_failure_seen_right_after_completion_is_not_reused() -> None:
    flight: SingleFlight[str, object] = SingleFlight()
    work = Work(error=ValueError("bad"))
    work.release.set()
    with pytest.raises(ValueError):
        await flight.do("d1", work)
    ok = Work()
    ok.release.set()
    assert await flight.do("d1", ok) == "tokens"


async def test_synchronous_error_in_fn_reaches_the_caller() -> None:
    flight: SingleFlight[str, object] = SingleFlight()

    def broken():
        raise KeyError("no awaitable")

    with pytest.raises(KeyError):
        await flight.do("d1", broken)
    assert not flight.in_flight("d1")


async def test_cancelled_waiter_does_not_cancel_the_others() -> None:
    flight: SingleFlight[str, object] = SingleFlight()
    work = Work()
    waiters = [asyncio.create_task(flight.do("d1", work)) for _ in range(3)]
    await work.started.wait()
    waiters[0].cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiters[0]
    assert flight.in_flight("d1") and work.cancelled == 0
    work.release.set()
    assert await asyncio.gather(*waiters[1:]) == ["tokens", "tokens"]
    assert work.calls == 1 and work.cancelled == 0


async def test_last_waiter_leaving_cancels_the_work() -> None:
    flight: SingleFlight[str, object] = SingleFlight()
    work = Work()
    waiter = asyncio.create_task(flight.do("d1", work))
    await work.started.wait()
    waiter.cancel()
    # A caller arriving while the abandoned call unwinds starts afresh instead of inheriting
    # the cancellation.
    fresh = Work(value="fresh")
    fresh.release.set()
    late = asyncio.create_task(flight.do("d1", fresh))
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert await late == "fresh"
    await asyncio.sleep(0)
    assert work.cancelled == 1 and not flight.in_flight("d1")


async def test_abandoned_work_can_run_to_completion() -> None:
    flight: SingleFlight[str, object] = SingleFlight(cancel_abandoned=False)
    work = Work()
    waiter = asyncio.create_task(flight.do("d1", work))
    await work.started.wait()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert flight.in_flight("d1")
    joined = asyncio.create_task(flight.wait("d1"))
    await asyncio.sleep(0)
    work.release.set()
    assert await joined == "tokens"
    assert work.cancelled == 0 and work.calls == 1


async def test_wait_joins_or_returns_none() -> None:
    flight: SingleFlight[str, object] = SingleFlight()
    assert await flight.wait("d1") is None
    work = Work()
    leader = asyncio.create_task(flight.do("d1", work))
    await work.started.wait()
    follower = asyncio.create_task(flight.wait("d1"))
    await asyncio.sleep(0)
    work.release.set()
    assert await leader == "tokens" and await follower == "tokens"
    assert work.calls == 1


async def test_keys_are_independent() -> None:
    flight: SingleFlight[str, object] = SingleFlight()
    a, b = Work("a"), Work("b")
    ta = asyncio.create_task(flight.do("a", a))
    tb = asyncio.create_task(flight.do("b", b))
    await asyncio.gather(a.started.wait(), b.started.wait())
    b.release.set()
    assert await tb == "b" and not ta.done()
    a.release.set()
    assert await ta == "a"
