"""Fair share of the engine between API keys (owners), on the queue policy and the real model.

The policy alone (`gateway.engine.local.fair_queue`, pure Python): owners take turns, each owner's
own
requests keep their order, a preempted request keeps its owner's place, the prefill budget is
split max-min fairly, and the sequence preempted is never the oldest running one.

On the real engine: a key with a queue of long requests does not hold up another key's short
one (it joins the batch at the next step and is done before most of the long ones), a long
prompt does not take every prefill chunk while another key's short prompt waits, one key is
held to its share of the queue while another key is still let in, and every greedy answer is
the same as when it runs alone. Order is read from the scheduler's own steps, not from clocks.
"""

from __future__ import annotations

import asyncio
import functools
import random
from dataclasses import dataclass

import pytest

from gateway.engine.interface import EngineBusy, GenerationRequest, Message, SamplingParams
from gateway.engine.local.fair_queue import FairQueue, newest_of_largest, share_budget
from gateway.engine.local.local_engine import LocalEngine
from gateway.server.app import build_engine
from gateway.settings import Settings, SettingsError
from gateway.testing.engine_requests import text_requests
from gateway.testing.waiting import eventually

# -- the policy, without the model ----------------------------------------------------------------


@dataclass(eq=False)
class Req:
    owner: str | None
    n: int
    order: int = 0


def queue_of(*items: Req) -> FairQueue[Req]:
    q: FairQueue[Req] = FairQueue(lambda r: r.owner)
    for item in items:
        q.push(item)
    return q


def serve_all(q: FairQueue[Req]) -> list[Req]:
    served = []
    while (item := q.peek()) is not None:
        q.take(item)
        served.append(item)
    return served


def test_owners_take_turns_and_each_owner_keeps_its_order() -> None:
    hog = [Req("hog", i) for i in range(100)]
    guest = Req("guest", 0)
    q = queue_of(*hog)
    q.push(guest)
    assert len(q) == 101 and q.owners == 2
    assert q.depth("hog") == 100 and q.depth("guest") == 1 and q.depth("nobody") == 0
    served = serve_all(q)
    assert served.index(guest) == 1  # one of the hog's, then the guest: not 100 of them
    assert [r for r in served if r.owner == "hog"] == hog  # first in, first out within one
    assert len(q) == 0 and q.owners == 0 and q.peek() is None


def test_three_owners_alternate_until_one_runs_out() -> None:
    a = [Req("a", i) for i in range(4)]
    b = [Req("b", i) for i in range(2)]
    c = [Req(None, i) for i in range(3)]  # anonymous requests are one owner
    q = queue_of(*a, *b, *c)
    assert q.owners == 3
    served = serve_all(q)
    assert [(r.owner, r.n) for r in served] == [
        ("a", 0),
        ("b", 0),
        (None, 0),
        ("a", 1),
        ("b", 1),
        (None, 1),
        ("a", 2),
        (None, 2),
        ("a", 3),
    ]


def test_preempted_request_goes_first_in_its_line_without_taking_another_owners_turn() -> None:
    a0, a1, b0, b1 = Req("a", 0), Req("a", 1), Req("b", 0), Req("b", 1)
    q = queue_of(a0, a1, b0, b1)
    q.take(a0)  # a0 admitted: b's turn next
    assert q.peek() is b0
    q.push_front(a0)  # a0 preempted: first of a's line, a keeps its place behind b
    assert q.peek() is b0
    assert serve_all(q) == [b0, a0, b1, a1]
    # an owner with nothing waiting comes back after the owners that are waiting
    c0, d0 = Req("c", 0), Req("d", 0)
    q = queue_of(d0)
    q.push_front(c0)
    assert serve_all(q) == [d0, c0]


def test_discard_and_drain_keep_the_books() -> None:
    a0, a1, b0 = Req("a", 0), Req("a", 1), Req("b", 0)
    q = queue_of(a0, a1, b0)
    assert q.discard(a1) and not q.discard(a1)  # cancelled while waiting; twice is a no-op
    assert q.discard(a0)  # the head, discarded (not served): a's turn does not pass to b...
    assert q.owners == 1 and q.peek() is b0  # ...but a has nothing left
    q.push(a0)
    assert len(q) == 2 and list(q) == [b0, a0]
    assert q.drain() == [b0, a0] and len(q) == 0 and q.owners == 0
    with pytest.raises(KeyError):
        q.take(a0)


def test_an_owner_served_out_of_turn_goes_to_the_back() -> None:
    # a full batch gives a slot to the first owner with nothing running, whoever's turn it is
    a0, a1, b0, b1, c0 = Req("a", 0), Req("a", 1), Req("b", 0), Req("b", 1), Req("c", 0)
    q = queue_of(a0, a1, b0, b1, c0)
    assert list(q.heads()) == [a0, b0, c0]
    q.take(b0)
    assert list(q.heads()) == [a0, c0, b1]
    q.take(a1)  # not the head of its line: no turn used
    assert list(q.heads()) == [a0, c0, b1] and len(q) == 3


def test_random_traffic_keeps_counts_and_turns_fair() -> None:
    rng = random.Random(7)
    q: FairQueue[Req] = FairQueue(lambda r: r.owner)
    waiting: list[Req] = []
    for step in range(4000):
        op = rng.random()
        if op < 0.5:
            item = Req(rng.choice(["a", "b", "c", None]), step)
            q.push(item)
            waiting.append(item)
        elif op < 0.6 and waiting:
            item = rng.choice(waiting)
            assert q.discard(item)
            waiting.remove(item)
        elif waiting:
            head = q.peek()
            assert head is not None
            # the head is the oldest waiting request of its owner
            assert head is min((r for r in waiting if r.owner == head.owner), key=lambda r: r.n)
            q.take(head)
            waiting.remove(head)
        assert len(q) == len(waiting)
        assert q.owners == len({r.owner for r in waiting})
        for owner in ("a", "b", "c", None):
            assert q.depth(owner) == sum(r.owner == owner for r in waiting)


def test_while_owners_stay_busy_none_is_served_twice_before_another_once() -> None:
    rng = random.Random(3)
    q: FairQueue[Req] = FairQueue(lambda r: r.owner)
    owners = ["a", "b", "c"]
    for owner in owners:  # everyone always has more waiting
        for i in range(50):
            q.push(Req(owner, i))
    served: list[str] = []
    for _ in range(60):
        head = q.peek()
        assert head is not None
        q.take(head)
        served.append(head.owner)  # type: ignore[arg-type]
        if rng.random() < 0.3:
            q.push(Req(rng.choice(owners), 99))
    for i in range(0, 60, 3):
        assert sorted(served[i : i + 3]) == owners


@pytest.mark.parametrize(
    ("demands", "budget", "want"),
    [
        ([4000, 30], 256, [226, 30]),  # the short prompt is done in one step
        ([4000, 4000], 256, [128, 128]),
        ([4000, 10, 50, 4000], 255, [98, 10, 50, 97]),
        ([5, 5], 256, [5, 5]),
        ([0, 100], 64, [0, 64]),
        ([100], 0, [0]),
        ([], 64, []),
    ],
)
def test_prefill_budget_is_split_max_min_fairly(demands, budget, want) -> None:
    assert share_budget(demands, budget) == want


def test_prefill_remainder_rotates_between_owners() -> None:
    # 3 tokens over 4 owners that each want more: one each, from `start` on, wrapping around
    assert share_budget([9, 9, 9, 9], 3, start=0) == [1, 1, 1, 0]
    assert share_budget([9, 9, 9, 9], 3, start=2) == [1, 0, 1, 1]
    assert share_budget([9, 9, 9, 9], 3, start=7) == [1, 1, 0, 1]


def test_prefill_split_properties_on_random_demands() -> None:
    rng = random.Random(11)
    for _ in range(2000):
        demands = [rng.choice([0, 1, 3, 16, 200, 5000]) for _ in range(rng.randint(1, 7))]
        budget = rng.randint(0, 600)
        grants = share_budget(demands, budget, start=rng.randint(0, 10))
        assert all(0 <= g <= d for g, d in zip(grants, demands, strict=True))
        assert sum(grants) == min(budget, sum(demands))
        # max-min fair: an owner left wanting got at least as much as anyone else, less one
        for g, d in zip(grants, demands, strict=True):
            if g < d:
                assert all(g >= other - 1 for other in grants)


def test_preemption_takes_the_newest_of_the_owner_holding_the_most() -> None:
    def running(*owners: str) -> list[Req]:
        return [Req(o, 0, order=i) for i, o in enumerate(owners)]

    def pick(items: list[Req]) -> Req | None:
        return newest_of_largest(items, lambda r: r.owner, lambda r: r.order)

    batch = running("a", "a", "a", "b")
    assert pick(batch) is batch[2]  # b's one sequence is newer, but a holds three
    batch = running("a", "b", "a", "b")
    assert pick(batch) is batch[3]  # as many each: the newest of theirs
    assert pick([]) is None
    rng = random.Random(5)
    for _ in range(500):  # the oldest running sequence is never preempted while another runs
        batch = running(*(rng.choice("abc") for _ in range(rng.randint(2, 9))))
        rng.shuffle(batch)
        assert pick(batch) is not min(batch, key=lambda r: r.order)


def test_per_key_cap_default_and_setting() -> None:
    assert LocalEngine(max_queue=256).max_queue_per_key == 64  # a quarter
    assert LocalEngine(max_queue=8).max_queue_per_key == 4  # at least 4
    assert LocalEngine(max_queue=2).max_queue_per_key == 2  # never more than the queue
    assert LocalEngine(max_queue=256, max_queue_per_key=10).max_queue_per_key == 10
    with pytest.raises(ValueError):
        LocalEngine(max_queue_per_key=-1)
    with pytest.raises(SettingsError, match="ENGINE_MAX_QUEUE_PER_KEY"):
        Settings.load({"engine_max_queue_per_key": -1}, environ={})
    keyed = Settings.load({"api_keys": ["k1", "k2"], "engine_max_queue": 100}, environ={})
    assert build_engine(keyed).max_queue_per_key == 25
    # without API keys every caller is one owner: its share is the whole queue
    open_ = Settings.load({"engine_max_queue": 100}, environ={})
    assert build_engine(open_).max_queue_per_key == 100
    env = Settings.load({}, environ={"VISIONGATE_ENGINE_MAX_QUEUE_PER_KEY": "7"})
    assert build_engine(env).max_queue_per_key == 7


# -- on the real model ----------------------------------------------------------------------------

LONG = [
    "Write a long story about a dragon who lives in a castle.",
    "Describe, in many sentences, a walk through a forest in autumn.",
]
HI = "Say hi."


ask = text_requests("fair")  # ask(text, max_tokens, salt, request_id)


def record(sched) -> list[tuple[str, str]]:
    """Events of the scheduler, in the order they happen: ("submit" | "admit" | "token" |
    "finish", request id) and ("step", "")."""
    events: list[tuple[str, str]] = []
    submit, start, advance, finish, step = (
        sched.submit,
        sched.admission._start,
        sched._advance,
        sched._finish,
        sched._step,
    )

    def on_submit(job):
        events.append(("submit", job.request.request_id))
        return submit(job)

    def on_start(seq):
        events.append(("admit", seq.request.request_id))
        return start(seq)

    def on_advance(seq, logits, now):
        events.append(("token", seq.request.request_id))
        return advance(seq, logits, now)

    def on_finish(seq, reason, now):
        events.append(("finish", seq.request.request_id))
        return finish(seq, reason, now)

    def on_step():
        if sched.admission.running:
            events.append(("step", ""))
        return step()

    sched.submit, sched.admission._start, sched._advance = on_submit, on_start, on_advance
    sched._finish, sched._step = on_finish, on_step
    return events


until = functools.partial(eventually, timeout=120, interval=0.002)


@pytest.mark.slow
async def test_short_request_of_another_key_overtakes_a_queue_of_long_ones(engine, collect) -> None:
    twin = engine.replica(max_batch=2, max_queue=32, max_queue_per_key=16)
    await twin.start()
    sched = twin._scheduler
    try:
        # each prompt alone first, under keys of their own (nothing cached is shared)
        solo = {}
        for i, text in enumerate(LONG):
            solo[text] = (await collect(twin, ask(text, 16, f"solo-{i}")))[1].text
        solo[HI] = (await collect(twin, ask(HI, 4, "solo-hi")))[1].text
        events = record(sched)
        hogs = [ask(LONG[i % 2], 16, "hog", f"hog-{i}") for i in range(6)]
        hog_tasks = [asyncio.create_task(collect(twin, r)) for r in hogs]
        await until(lambda: twin.stats().running == 2 and twin.stats().waiting == 4)
        _, guest = await collect(twin, ask(HI, 4, "guest", "guest"))
        results = [r for _, r in await asyncio.gather(*hog_tasks)]
    finally:
        await twin.aclose()
    submitted = events.index(("submit", "guest"))
    admitted = events.index(("admit", "guest"))
    steps_waited = sum(kind == "step" for kind, _ in events[submitted:admitted])
    assert steps_waited <= 1, "the guest waited for more than the step under way"
    finished = [rid for kind, rid in events if kind == "finish"]
    hogs_first = finished.index("guest")
    assert hogs_first <= 2 < len(hogs) // 2, finished  # at most the two it found running
    # the batch was full of the hog's: one of them made room, and came back later
    assert sum(r.preemptions for r in results) >= 1
    assert guest.text == solo[HI]
    for request, result in zip(hogs, results, strict=True):
        assert result.text == solo[request.messages[0].content[0]], request.request_id


@pytest.mark.slow
async def test_a_long_prompt_shares_the_prefill_budget_with_a_short_one(engine, collect) -> None:
    twin = engine.replica(max_batch=4, prefill_chunk_tokens=32)
    await twin.start()
    sched = twin._scheduler
    long_text = "word " * 480 + "How many words is that?"
    try:
        _, long_solo = await collect(twin, ask(long_text, 4, "solo-long"))
        _, hi_solo = await collect(twin, ask(HI, 3, "solo-hi"))
        events = record(sched)
        long_task = asyncio.create_task(collect(twin, ask(long_text, 4, "hog", "long")))
        await until(lambda: sched.admission.running and sched.admission.running[0].fed > 0)
        _, guest = await collect(twin, ask(HI, 3, "guest", "guest"))
        _, long_result = await long_task
    finally:
        await twin.aclose()
    assert long_result.input_tokens > 400
    # served first come, first served, the guest's prompt would wait for all ~15 chunks of
    # the long one; sharing the budget, it is answered while the long prompt is still prefilled
    assert events.index(("finish", "guest")) < events.index(("token", "long"))
    assert guest.prefill_chunks <= -(-guest.input_tokens // 16)  # half the budget, each step
    assert long_result.preemptions == 0
    assert guest.text == hi_solo.text and long_result.text == long_solo.text


@pytest.mark.slow
async def test_one_key_is_held_to_its_share_of_the_queue(engine, collect) -> None:
    twin = engine.replica(max_batch=1, max_queue=16, max_queue_per_key=2)
    await twin.start()
    sched = twin._scheduler
    try:
        events = record(sched)
        running = ask(LONG[0], 400, "hog", "hog-running")
        running_task = asyncio.create_task(collect(twin, running))
        await until(lambda: twin.stats().running == 1)
        queued = [
            asyncio.create_task(collect(twin, ask(f"Say {i}.", 3, "hog", f"hog-{i}")))
            for i in range(2)
        ]
        await until(lambda: twin.stats().waiting == 2)
        with pytest.raises(EngineBusy) as info:
            await collect(twin, ask("Say 9.", 3, "hog"))
        assert info.value.code == "busy" and info.value.retry_after_s >= 1
        assert "API key" in str(info.value)
        # another key, and the anonymous owner (every request without a key), still get in
        guest = asyncio.create_task(collect(twin, ask(HI, 3, "guest", "guest")))
        anonymous = [
            asyncio.create_task(collect(twin, ask(f"Say {i}.", 3, None, f"anon-{i}")))
            for i in range(2)
        ]
        await until(lambda: twin.stats().waiting == 5)
        assert sched.owners_waiting == 3
        with pytest.raises(EngineBusy):  # requests without a key share one line
            await collect(twin, ask("Say 9.", 3, None))
        assert twin.stats().running == 1  # the long one ran all along
        running.cancel.set()
        _, cut = await running_task
        outcomes = await asyncio.gather(*queued, guest, *anonymous)
    finally:
        await twin.aclose()
    assert cut.finish_reason == "cancelled"
    assert all(r.finish_reason in ("stop", "length") for _, r in outcomes)
    admitted = [rid for kind, rid in events if kind == "admit"]
    # in turns: the hog's line was first, then the guest's, then the anonymous one
    assert admitted == ["hog-running", "hog-0", "guest", "anon-0", "hog-1", "anon-1"]


@pytest.mark.slow
async def test_a_burst_into_an_idle_batch_is_not_held_to_the_share(engine, collect) -> None:
    # what the free slots take at the next step does not count against the key
    twin = engine.replica(max_batch=4, max_queue=16, max_queue_per_key=2)
    await twin.start()
    try:
        burst = [collect(twin, ask(f"Say {i}.", 2, "burst")) for i in range(6)]
        results = await asyncio.gather(*burst)
        assert all(r.output_tokens >= 1 for _, r in results)
        long = ask(LONG[0], 300, "burst", "long")
        running = asyncio.create_task(collect(twin, long))
        await until(lambda: twin.stats().running == 1)
        # 3 slots free: 2 + 3 may wait, the sixth is refused
        more = [asyncio.create_task(collect(twin, ask(f"Say {i}.", 2, "burst"))) for i in range(5)]
        await asyncio.sleep(0)
        with pytest.raises(EngineBusy):
            await collect(twin, ask("Say 9.", 2, "burst"))
        long.cancel.set()
        await asyncio.gather(running, *more)
    finally:
        await twin.aclose()


def test_least_served_owner_is_prefilled_first_after_a_floor_for_all() -> None:
    from gateway.engine.local.fair_queue import share_budget_least_served

    # a heavy owner (served 5000 lately) and a new one: the new one gets all it asks for
    assert share_budget_least_served([2000, 300], [5000.0, 0.0], 256) == [32, 224]
    # demands below the budget are all met, whoever was served
    assert share_budget_least_served([100, 50], [9.0, 1.0], 256) == [100, 50]
    # everyone keeps a floor: budget // (4 * owners) each
    assert share_budget_least_served([1000, 1000, 1000], [0.0, 10.0, 20.0], 240) == [200, 20, 20]
    assert share_budget_least_served([0, 0], [0.0, 0.0], 256) == [0, 0]


def test_recent_service_fades_by_half_life() -> None:
    from gateway.engine.local.fair_queue import RecentService

    now = [0.0]
    served = RecentService(10.0, clock=lambda: now[0])
    served.add("a", 1000)
    served.add("b", 1.5)
    now[0] = 10.0
    faded = served.now()
    assert faded["a"] == pytest.approx(500) and "b" not in faded  # below one unit: dropped
    now[0] = 30.0
    assert served.now()["a"] == pytest.approx(125)


@pytest.mark.slow
async def test_a_key_with_nothing_running_claims_kv_memory_from_the_largest(
    engine, collect
) -> None:
    long_text = "word " * 400 + "How many words is that?"
    # room for two of the long prompts' KV at a time, whatever the batch size
    twin = engine.replica(
        max_batch=8,
        max_queue=32,
        max_queue_per_key=16,
        kv_budget_bytes=48 * 1024 * 1024,
        prefix_caching=False,
    )
    await twin.start()
    sched = twin._scheduler
    try:
        solo_long = (await collect(twin, ask(long_text, 24, "solo-long")))[1]
        # the guest's prompt is too long for the room the two running hogs leave
        medium = "word " * 200 + "Say hi."
        solo_hi = (await collect(twin, ask(medium, 4, "solo-hi")))[1]
        events = record(sched)
        hogs = [ask(long_text, 24, "hog", f"hog-{i}") for i in range(4)]
        hog_tasks = [asyncio.create_task(collect(twin, r)) for r in hogs]
        await until(lambda: twin.stats().running == 2 and twin.stats().waiting == 2)
        _, guest = await collect(twin, ask(medium, 4, "guest", "guest"))
        results = [r for _, r in await asyncio.gather(*hog_tasks)]
    finally:
        await twin.aclose()
    submitted = events.index(("submit", "guest"))
    admitted = events.index(("admit", "guest"))
    steps_waited = sum(kind == "step" for kind, _ in events[submitted:admitted])
    assert steps_waited <= 1, "the guest waited for KV memory held by another key"
    assert sum(r.preemptions for r in results) >= 1  # a hog made room, and came back
    assert guest.text == solo_hi.text
    assert all(r.text == solo_long.text for r in results)


@pytest.mark.slow
async def test_beside_a_light_key_heavy_keys_feed_a_few_positions_a_step(engine, collect) -> None:
    """A key with long prompts in the batch counts as heavy at once; while another key's short
    request is in the batch, the heavy key's sequences together feed at most a sixteenth of the
    step budget (its decodes taking turns, none left behind), so the short request's steps cost
    about what they would alone; nobody's greedy answer changes."""
    chunk = 64
    twin = engine.replica(max_batch=8, max_queue=16, prefill_chunk_tokens=chunk)
    await twin.start()
    sched = twin._scheduler
    bulk_texts = [f"item{i} " * 60 + "Count them." for i in range(6)]
    try:
        _, hi_solo = await collect(twin, ask(HI, 6, "solo-hi"))
        _, bulk_solo = await collect(twin, ask(bulk_texts[0], 40, "solo-bulk"))
        steps: list[dict[str, int]] = []
        plan = sched._plan

        def recording_plan():
            running = {s.request.request_id for s in sched.admission.running}
            chosen = plan()
            fed: dict[str, int] = {}
            for s, _, n in chosen:
                fed[s.request.request_id] = fed.get(s.request.request_id, 0) + n
            steps.append((fed, running))
            return chosen

        sched._plan = recording_plan
        bulk = [
            asyncio.create_task(collect(twin, ask(text, 40, "bulk", f"bulk-{i}")))
            for i, text in enumerate(bulk_texts)
        ]
        running = sched.admission.running
        await until(lambda: len(running) == 6 and all(s.generated for s in running))
        _, hi = await collect(twin, ask(HI, 6, "chat", "chat"))
        results = await asyncio.gather(*bulk)
    finally:
        await twin.aclose()
    beside = [(fed, running) for fed, running in steps if "chat" in fed]
    assert beside, steps
    room = chunk // 16
    for fed, _ in beside:
        assert sum(n for rid, n in fed.items() if rid.startswith("bulk")) <= room, fed
    # the bulk decodes took turns: none sat out more than two steps in a row beside the chat
    # (counting only the steps it was running in: one may finish early)
    assert sum(f"bulk-{i}" in beside[0][1] for i in range(6)) > room  # more than the room
    for i in range(6):
        run = longest = 0
        for fed, running in beside:
            if f"bulk-{i}" in running:
                run = 0 if f"bulk-{i}" in fed else run + 1
                longest = max(longest, run)
        assert longest <= 2, (i, beside)
    assert hi.text == hi_solo.text
    assert results[0][1].text == bulk_solo.text
    assert all(r.finish_reason in ("stop", "length") for _, r in results)


class _Seq:
    """What `StepPlanner.plan` reads of a sequence."""

    def __init__(self, owner: str, order: int, known: int, fed: int) -> None:
        self.owner, self.order, self.known, self.fed, self.held = owner, order, known, fed, 0


def _planner(chunk: int, served: dict[str, float]):
    """A step planner as a CPU engine's, with `served` as its owners' recent prefill."""
    from types import SimpleNamespace

    from gateway.engine.local.fair_queue import RecentService
    from gateway.engine.local.step_plan import StepPlanner

    now = [0.0]
    config = SimpleNamespace(prefill_chunk_tokens=chunk)
    record = RecentService(10.0, clock=lambda: now[0])
    for owner, amount in served.items():
        record.add(owner, amount)
    return StepPlanner(config, hold_decodes=True, served=record)  # type: ignore[arg-type]


def test_a_light_prompt_gets_what_the_heavy_keys_cannot_use() -> None:
    # a key with a long prompt in hand is heavy at once, though served less than the light key
    # lately: its cut must not be taken from the budget the light key's prompt could use
    heavy = _Seq("bulk", 0, known=10_000, fed=0)
    light = _Seq("chat", 1, known=200, fed=0)
    plan = _planner(256, {"chat": 500.0}).plan([heavy, light], [], 0)  # no warm-ups
    fed = {s.owner: n for s, _, n in plan}
    assert fed == {"bulk": 16, "chat": 200}


@pytest.mark.parametrize("chunk", [16, 32, 48, 64, 256])
def test_a_heavy_prompt_advances_beside_a_light_key_whatever_the_chunk(chunk: int) -> None:
    decoders = [_Seq("bulk", i, known=50, fed=49) for i in range(20)]
    prompts = [_Seq(f"other-{i}", 100 + i, known=5_000, fed=0) for i in range(3)]
    light = _Seq("chat", 200, known=31, fed=30)
    planner = _planner(chunk, {"bulk": 5_000.0})
    running = [*decoders, *prompts, light]
    for step in range(6):
        plan = planner.plan(running, [], step)  # type: ignore[arg-type]
        heavy_fed = sum(n for s, _, n in plan if s.owner != "chat")
        assert heavy_fed <= max(chunk // 16, 1) + 1, (chunk, plan)
        assert any(s.owner.startswith("other") and n > 0 for s, _, n in plan), (chunk, step)
        assert any(s.owner == "chat" for s, _, n in plan)
        for s, start, n in plan:
            s.fed = start + n
            if s.fed == s.known:
                s.known += 1  # a token was sampled: the next position is known
    # the prefill room rotates between the heavy keys rather than feeding one of them
    assert all(p.fed > 0 for p in prompts), [p.fed for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("session_owner", ["chat", "hog"])
async def test_a_heavy_key_waits_rather_than_evict_another_keys_session_kv(
    engine, collect, session_owner: str
) -> None:
    """A heavy key with a sequence running is admitted only into the room that running
    sequences and other keys' sessions' pinned blocks leave: its next long prompt waits for its
    first one to end instead of evicting another key's session, whose next turn then reuses its
    history. (Before, the admission emptied the cache, pins included, and the turn prefilled it
    all.) Its own sessions' pins are its to give up: when the session is the heavy key's, the
    second long prompt runs beside the first at once (before, one owner serving many sessions
    saw each new prompt wait for all its running ones to end once pins filled the budget)."""
    from gateway.engine.local.sequence import GROW

    long_texts = [f"part{i} " * 150 + "How many parts?" for i in range(2)]
    first = GenerationRequest(
        "chat-1", [Message("user", ["Say hi."])], SamplingParams(max_output_tokens=8)
    )
    solo = engine.replica(max_batch=4, max_queue=16, prefill_chunk_tokens=64)
    await solo.start()
    pos_bytes = solo._scheduler.kv.pos_bytes
    try:
        sizes = []
        for i, text in enumerate(long_texts):
            _, r = await collect(solo, ask(text, 8, "solo", f"solo-{i}"))
            sizes.append(r.input_tokens)
        hog_solo = [r for _, r in [await collect(solo, ask(t, 8, "solo2")) for t in long_texts]]
    finally:
        await solo.aclose()
    need = [(n + GROW) * pos_bytes for n in sizes]
    # both long prompts fit beside each other only if the chat's session gives up its KV
    budget = need[0] + need[1] + 24 * pos_bytes
    twin = engine.replica(
        max_batch=4, max_queue=16, prefill_chunk_tokens=64, kv_budget_bytes=budget
    )
    await twin.start()
    sched = twin._scheduler
    try:
        first.kv_key, first.owner = "sess-chat", session_owner
        _, chat_1 = await collect(twin, first)
        assert await asyncio.to_thread(sched.barrier, 30)  # its KV is in the cache
        assert sched.kv.pinned_bytes >= 32 * pos_bytes  # the session's turn, pinned
        events = record(sched)
        hogs = [
            asyncio.create_task(collect(twin, ask(t, 8, "hog", f"hog-{i}")))
            for i, t in enumerate(long_texts)
        ]
        results = [r for _, r in await asyncio.gather(*hogs)]
        history = [Message("user", ["Say hi."]), Message("assistant", [chat_1.text])]
        second = GenerationRequest(
            "chat-2",
            [*history, Message("user", ["And again?"])],
            SamplingParams(max_output_tokens=4),
            kv_key="sess-chat",
            owner=session_owner,
        )
        _, chat_2 = await collect(twin, second)
    finally:
        await twin.aclose()
    assert [r.text for r in results] == [r.text for r in hog_solo]
    if session_owner == "hog":  # its own session's pin went: the two ran side by side
        assert events.index(("admit", "hog-1")) < events.index(("finish", "hog-0")), events
        return
    # the second long prompt was admitted after the first ended, not beside it
    assert events.index(("admit", "hog-1")) > events.index(("finish", "hog-0")), events
    assert chat_2.cached_tokens >= chat_1.input_tokens, (chat_1, chat_2)
