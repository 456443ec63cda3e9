"""The gate in front of the Redis encoder's job stream: a bounded number of holders, waiters let
in round-robin by owner, cancellation never losing or leaking a place."""

from __future__ import annotations

import asyncio

import pytest

from gateway.policy.fair_gate import FairGate


async def test_waiters_enter_in_turn_by_owner_first_in_first_out_within_one() -> None:
    gate = FairGate(limit=2)
    entered: list[str] = []
    release = asyncio.Event()

    async def job(owner: str, name: str) -> None:
        async with gate.hold(owner):
            entered.append(name)
            await release.wait()

    # key a queues eight jobs before key b's one: b enters right after the two running
    tasks = [asyncio.create_task(job("a", f"a{i}")) for i in range(8)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(job("b", "b0")))
    await asyncio.sleep(0.01)
    assert entered == ["a0", "a1"] and gate.held == 2 and gate.waiting == 7
    release.set()
    await asyncio.gather(*tasks)
    assert entered[:4] == ["a0", "a1", "a2", "b0"]  # b0 waits for one of a, not for seven
    assert [n for n in entered if n.startswith("a")] == [f"a{i}" for i in range(8)]
    assert gate.held == 0 and gate.waiting == 0


async def test_owners_alternate_while_both_have_work() -> None:
    gate = FairGate(limit=1)
    entered: list[str] = []
    step = asyncio.Event()

    async def job(owner: str, name: str) -> None:
        async with gate.hold(owner):
            entered.append(name)
            await step.wait()

    first = asyncio.create_task(job("a", "a0"))
    await asyncio.sleep(0)
    rest = [asyncio.create_task(job("a", f"a{i}")) for i in range(1, 4)]
    rest += [asyncio.create_task(job("b", f"b{i}")) for i in range(3)]
    await asyncio.sleep(0.01)
    step.set()
    await asyncio.gather(first, *rest)
    assert entered == ["a0", "a1", "b0", "a2", "b1", "a3", "b2"]


async def test_a_cancelled_waiter_leaves_no_trace_and_a_cancelled_holder_passes_on() -> None:
    gate = FairGate(limit=1)
    hold = asyncio.Event()

    async def job(owner: str) -> None:
        async with gate.hold(owner):
            await hold.wait()

    running = asyncio.create_task(job("a"))
    await asyncio.sleep(0)
    waiting = asyncio.create_task(job("b"))
    await asyncio.sleep(0)
    assert gate.waiting == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert gate.waiting == 0 and gate.held == 1
    later = asyncio.create_task(job("c"))
    await asyncio.sleep(0)
    running.cancel()  # the holder goes: its place passes to c
    with pytest.raises(asyncio.CancelledError):
        await running
    await asyncio.sleep(0)
    assert gate.held == 1 and gate.waiting == 0
    hold.set()
    await later
    assert gate.held == 0
    with pytest.raises(ValueError):
        FairGate(0)
