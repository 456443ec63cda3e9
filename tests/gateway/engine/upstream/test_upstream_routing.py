"""Replica choice for the upstream engine: rendezvous affinity, bounded load, health.

The ordering rules run on `Router` itself; affinity and recovery also run through a real
`OpenAIEngine` on scripted loopback replicas (gateway/testing/upstream_fake.py)."""

from __future__ import annotations

import functools
from collections import Counter

import pytest

from gateway.engine.interface import (
    GenerationRequest,
    GenerationResult,
    ImageInput,
    Message,
    TextDelta,
)
from gateway.engine.upstream.endpoints import parse_upstream
from gateway.engine.upstream.openai_engine import OpenAIEngine
from gateway.engine.upstream.routing import Replica, Router, route_key
from gateway.testing.upstream_fake import FakeUpstream
from gateway.testing.waiting import eventually

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 4)]


def router(load_factor: float = 1.25, min_load: int = 1) -> Router:
    replicas = [Replica(parse_upstream(u)) for u in URLS]
    for r in replicas:
        r.healthy = True
    return Router(replicas, load_factor=load_factor, min_load=min_load)


def test_a_light_load_stays_where_its_prefix_is() -> None:
    """Under the floor a conversation's replica keeps it, however uneven the load; past the
    floor the proportional bound moves the excess."""
    r = router(min_load=4)
    key = route_key(chat(kv_key="session-light"))
    first = r.order(key)[0]
    first.in_flight = 3  # three turns of that conversation at once, nothing elsewhere
    assert r.order(key)[0] is first
    first.in_flight = 4
    assert r.order(key)[0] is not first


def chat(
    text: str = "hi", *, kv_key: str | None = None, salt: str | None = "key-a"
) -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        messages=[Message("system", ["be brief"]), Message("user", [text])],
        kv_key=kv_key,
        cache_salt=salt,
    )


def test_same_key_same_replica_and_keys_spread() -> None:
    r = router()
    first = {f"s{i}": r.order(route_key(chat(kv_key=f"s{i}")))[0].name for i in range(300)}
    again = {f"s{i}": r.order(route_key(chat(kv_key=f"s{i}")))[0].name for i in range(300)}
    assert first == again
    spread = Counter(first.values())
    assert set(spread) == {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
    assert min(spread.values()) >= 60, spread  # 100 each on average


def test_losing_a_replica_moves_only_its_keys() -> None:
    r = router()
    before = {k: r.order(route_key(chat(kv_key=k)))[0] for k in (f"s{i}" for i in range(200))}
    lost = r.replicas[1]
    lost.healthy = False
    after = {k: r.order(route_key(chat(kv_key=k)))[0] for k in before}
    for key, replica in before.items():
        if replica is not lost:
            assert after[key] is replica
        else:
            assert after[key] is not lost


def test_stateless_history_routes_by_its_opening() -> None:
    opening = [Message("system", ["be brief"]), Message("user", ["what is this?"])]
    image = ImageInput("ab" * 32, None, data=b"x", mime="image/png")
    turn1 = GenerationRequest("r1", [*opening[:1], Message("user", ["what is this?", image])])
    turn3 = GenerationRequest(
        "r3",
        [
            *turn1.messages,
            Message("assistant", ["a cat"]),
            Message("user", ["and its colour?"]),
        ],
    )
    assert route_key(turn1) == route_key(turn3)
    other_image = ImageInput("cd" * 32, None, data=b"y", mime="image/png")
    other = GenerationRequest("r4", [*opening[:1], Message("user", ["what is this?", other_image])])
    assert route_key(other) != route_key(turn1)
    # the namespace is part of the key; a session id replaces the opening
    assert route_key(chat(salt="key-a")) != route_key(chat(salt="key-b"))
    assert route_key(chat("one", kv_key="s1")) == route_key(chat("two", kv_key="s1"))


def test_bounded_load_moves_the_excess() -> None:
    r = router()
    key = route_key(chat(kv_key="hot"))
    preferred = r.order(key)[0]
    # cap = ceil(1.25 * (total + 1) / 3): with 6 in flight on the preferred one, cap is 3
    preferred.in_flight = 6
    order = r.order(key)
    assert order[0] is not preferred and order[-1] is preferred
    # under the bound it keeps the key: 2 of 10 in flight, cap ceil(1.25 * 11 / 3) = 5
    preferred.in_flight = 2
    for other in order[:-1]:
        other.in_flight = 4
    assert r.order(key)[0] is preferred
    # every replica over the bound: score order stands
    for replica in r.replicas:
        replica.in_flight = 50
    assert r.order(key) == r.by_score(key)


def test_unhealthy_skipped_and_all_tried_when_none_is_up() -> None:
    r = router()
    key = route_key(chat(kv_key="s"))
    ranked = r.by_score(key)
    ranked[0].healthy = False
    assert ranked[0] not in r.order(key)
    assert r.order(key)[0] is ranked[1]
    for replica in r.replicas:
        replica.healthy = False
    assert r.order(key) == ranked  # one attempt each, in score order


def test_load_factor_below_one_refused() -> None:
    with pytest.raises(ValueError, match="load_factor"):
        router(load_factor=0.5)


async def _answer(engine: OpenAIEngine, request: GenerationRequest) -> str:
    text = []
    async for item in engine.generate(request):
        if isinstance(item, TextDelta):
            text.append(item.text)
        else:
            assert isinstance(item, GenerationResult)
    return "".join(text)


async def test_a_session_stays_on_its_replica_through_the_engine() -> None:
    with FakeUpstream() as a, FakeUpstream() as b, FakeUpstream() as c:
        fakes = {f.name: f for f in (a, b, c)}
        engine = OpenAIEngine([parse_upstream(f.url) for f in fakes.values()])
        await engine.start()
        try:
            for turn in range(4):
                assert await _answer(engine, chat(f"turn {turn}", kv_key="conv-1")) == (
                    "Hello, world"
                )
            served = [name for name, f in fakes.items() if f.chat_requests()]
            assert len(served) == 1
            assert len(fakes[served[0]].chat_requests()) == 4
            # many sessions use every replica
            for i in range(30):
                await _answer(engine, chat(kv_key=f"conv-{i + 2}"))
            assert all(f.chat_requests() for f in fakes.values())
        finally:
            await engine.aclose()


async def test_health_loop_takes_a_replica_out_and_brings_it_back() -> None:
    with FakeUpstream() as a, FakeUpstream() as b:
        engine = OpenAIEngine(
            [parse_upstream(a.url), parse_upstream(b.url)], health_interval_s=0.05
        )
        await engine.start()
        try:
            replicas = {r.name: r for r in engine._router.replicas}
            a.health_status = 503
            await _until(lambda: not replicas[a.name].healthy)
            assert engine.ready  # b still serves
            for i in range(6):  # every session now lands on b
                await _answer(engine, chat(kv_key=f"s{i}"))
            assert not a.chat_requests() and len(b.chat_requests()) == 6

            a.health_status = 200
            await _until(lambda: replicas[a.name].healthy)
            for i in range(30):
                await _answer(engine, chat(kv_key=f"t{i}"))
            assert a.chat_requests()  # back in the rotation

            # a replica that went away entirely (no listener): down, and ready again when back
            b.set_listening(False)
            await _until(lambda: not replicas[b.name].healthy)
            b.set_listening(True)
            await _until(lambda: replicas[b.name].healthy)
        finally:
            await engine.aclose()


async def test_health_falls_back_to_models_without_a_health_route() -> None:
    with FakeUpstream() as a:
        a.has_health = False
        engine = OpenAIEngine([parse_upstream(a.url)], health_interval_s=0.05)
        await engine.start()
        try:
            await _until(lambda: sum(r.path == "/v1/models" for r in a.requests) >= 3)
            assert engine.ready
            a.models_status = 503
            await _until(lambda: not engine.ready)
        finally:
            await engine.aclose()


async def test_replica_down_at_start_joins_once_it_answers() -> None:
    with FakeUpstream() as a, FakeUpstream() as b:
        b.set_listening(False)
        engine = OpenAIEngine(
            [parse_upstream(a.url), parse_upstream(b.url)], health_interval_s=0.05
        )
        await engine.start()
        try:
            replicas = {r.name: r for r in engine._router.replicas}
            assert replicas[a.name].healthy and not replicas[b.name].healthy
            b.set_listening(True)
            await _until(lambda: replicas[b.name].healthy)
            assert replicas[b.name].model == "fake-vlm"  # learned from its /v1/models
        finally:
            await engine.aclose()


# waits for the engine's own loop to make a condition true (a liveness bound, not timing)
_until = functools.partial(eventually, interval=0.02)
