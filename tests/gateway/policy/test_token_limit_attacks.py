"""An attacker's pass over the token limits of managed keys, over real gateways (the fake engine,
which counts a word as a token) on a real redis-server: prompts dense in tokens that the
admission's estimate must not undercount (else concurrent clients get more than the limit plus
one response), a response that fails after it streamed, the next request after an answer that
went over its output limit, and the headers of a key with no token limits."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.testing.fake_gateway import eventually
from gateway.testing.fakes import FakeEngine
from tests.gateway.api.admin.test_admin_keys import ADMIN, create
from tests.gateway.policy.test_key_token_limits import chat_body, fresh_minute, usage_of
from tests.gateway.policy.test_token_bursts import realtime_burst

BIG = 1_000_000
# as many tokens as characters allow: one-character words, digits, punctuation
DENSE = [
    " ".join("abcdefghij"[i % 10] for i in range(120)),
    " ".join(str(i % 10) for i in range(120)),
    "0123456789" * 12,
    "!?" * 60,
]


@pytest.fixture
def gateway(make_gateway, redis_url):
    return make_gateway(settings=dict(admin_api_key=ADMIN, redis_url=redis_url))


@pytest.fixture
def slow_replicas(make_gateway, redis_url):
    """Two replicas on one Redis whose answers take 0.3 s: slow enough that concurrent clients
    are all admitted before any answer's real count lands."""
    settings = dict(admin_api_key=ADMIN, redis_url=redis_url)
    return tuple(make_gateway(engine=FakeEngine(delay_s=0.3), settings=settings) for _ in "ab")


def estimate_of(response: httpx.Response) -> int:
    """What admission counted for the first response of a fresh key of BIG input tokens."""
    return BIG - int(response.headers["x-ratelimit-remaining-tokens"])


@pytest.mark.parametrize("text", DENSE, ids=["letters", "spaced-digits", "digits", "punct"])
def test_the_admission_estimate_does_not_undercount_dense_prompts(gateway, text) -> None:
    fresh_minute(5.0)
    for api, path, body, used in (
        ("chat", "/v1/chat/completions", chat_body(text, max_tokens=1), "prompt_tokens"),
        ("responses", "/v1/responses", {"model": "fake-echo", "input": text}, "input_tokens"),
        ("completions", "/v1/completions", {"model": "fake-echo", "prompt": text}, "prompt_tokens"),
    ):
        key = create(gateway.http_url, input_tpm=BIG)["secret"]
        r = httpx.post(
            f"{gateway.http_url}{path}",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        real = r.json()["usage"][used]
        assert estimate_of(r) >= real, (api, estimate_of(r), real)


async def test_concurrent_dense_prompts_stay_within_the_limit_plus_one(slow_replicas):
    a, b = slow_replicas
    limit = 400
    fresh_minute(10.0)
    key = create(a.http_url, input_tpm=limit)["secret"]
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=30) as client:

        async def one(i: int) -> httpx.Response:
            url = (a if i % 2 else b).http_url
            body = chat_body(DENSE[i % 2], max_tokens=1)
            return await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)

        answers = await asyncio.gather(*(one(i) for i in range(24)))
    assert {r.status_code for r in answers} == {200, 429}
    real = [r.json()["usage"]["prompt_tokens"] for r in answers if r.status_code == 200]
    assert sum(real) < limit + max(real), (sum(real), real)


async def test_a_stream_that_fails_midway_is_counted(make_gateway, redis_url) -> None:
    """The engine fails after 4 tokens went out: the key is charged for the prompt and the 4
    tokens (a client that could make answers fail would otherwise stream for free)."""
    gw = make_gateway(
        engine=FakeEngine(fail_after=4), settings=dict(admin_api_key=ADMIN, redis_url=redis_url)
    )
    fresh_minute(5.0)
    made = create(gw.http_url, output_tpm=BIG)
    words = " ".join(f"w{i}" for i in range(20))
    with httpx.stream(
        "POST",
        f"{gw.http_url}/v1/chat/completions",
        json=chat_body(words, stream=True),
        headers={"Authorization": f"Bearer {made['secret']}"},
        timeout=30,
    ) as stream:
        body = "".join(stream.iter_lines())
    assert "w0" in body
    assert "engine_error" in body

    def counted() -> bool:
        got = usage_of(gw.http_url, made["id"])
        return got["output_tokens"] >= 4 and got["input_tokens"] > 0

    await eventually(counted, timeout=5, what="the failed stream counted")


def test_past_the_output_limit_the_next_request_is_refused(gateway) -> None:
    """An answer under way is not cut; the one after it is refused, at once, on any API."""
    fresh_minute(5.0)
    made = create(gateway.http_url, output_tpm=5)
    headers = {"Authorization": f"Bearer {made['secret']}"}
    words = " ".join(f"w{i}" for i in range(30))
    first = httpx.post(
        f"{gateway.http_url}/v1/chat/completions", json=chat_body(words), headers=headers
    )
    assert first.status_code == 200
    assert first.json()["usage"]["completion_tokens"] > 5  # not cut
    for path, body in (
        ("/v1/chat/completions", chat_body("again")),
        ("/v1/responses", {"model": "fake-echo", "input": "again"}),
        ("/v1/completions", {"model": "fake-echo", "prompt": "again"}),
    ):
        r = httpx.post(f"{gateway.http_url}{path}", json=body, headers=headers)
        assert r.status_code == 429, (path, r.text)
        assert r.json()["error"]["code"] == "rate_limited"
        assert r.headers["x-ratelimit-remaining-tokens"] == "0"
        assert r.headers["x-ratelimit-limit-tokens"] == "5"


def test_a_key_without_token_limits_gets_no_token_headers(gateway) -> None:
    made = create(gateway.http_url, rpm=7)
    headers = {"Authorization": f"Bearer {made['secret']}"}
    url = f"{gateway.http_url}/v1/chat/completions"
    ok = httpx.post(url, json=chat_body("hi"), headers=headers)
    bad = httpx.post(
        f"{gateway.http_url}/v1/chat/completions",
        json=chat_body("hi", temperature=99),
        headers=headers,
    )
    assert ok.status_code == 200 and bad.status_code == 400
    for r in (ok, bad):
        assert not any(k.startswith("x-ratelimit-") and k.endswith("-tokens") for k in r.headers)
    assert ok.headers["x-ratelimit-limit-requests"] == "7"


async def test_an_abandoned_stream_counts_in_its_session_usage(make_gateway) -> None:
    """The client leaves mid-answer: the answer stays in the session (incomplete), and the
    session's usage counts it as the key's counters do (what streamed, the input estimate)."""
    gw = make_gateway(engine=FakeEngine(delay_s=0.05))
    session_id = "sess-abandoned-usage-1"
    words = " ".join(f"w{i}" for i in range(25))
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream(
            "POST",
            f"{gw.http_url}/v1/chat/completions",
            json=chat_body(words, stream=True),
            headers={"X-Session-Id": session_id},
        ) as stream,
    ):
        seen = 0
        async for line in stream.aiter_lines():
            seen += '"content":"' in line and '"content":""' not in line
            if seen >= 4:
                break

    def view() -> dict:
        return httpx.get(f"{gw.http_url}/v1/sessions/{session_id}").json()

    await eventually(
        lambda: view()["items"][-1].get("status") == "incomplete", timeout=5, what="kept"
    )
    usage = view().get("usage", {})
    assert usage.get("responses") == 1, view()
    assert 4 <= usage["output_tokens"] < 26
    assert usage["input_tokens"] >= 25


def test_many_prompts_and_choices_are_all_counted(gateway) -> None:
    """A legacy completion of 64 prompts, 3 answers each: the input of all 64 is estimated
    before admission, and every answer's output is counted."""
    fresh_minute(5.0)
    made = create(gateway.http_url, input_tpm=BIG, output_tpm=BIG)
    prompts = [f"p{i} one two three" for i in range(64)]
    r = httpx.post(
        f"{gateway.http_url}/v1/completions",
        json={"model": "fake-echo", "prompt": prompts, "n": 3, "max_tokens": 8},
        headers={"Authorization": f"Bearer {made['secret']}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 64 * 3
    # (the fake engine reports no input tokens for raw prompts: the estimate is checked alone)
    assert estimate_of(r) >= 64 * 5 and estimate_of(r) >= body["usage"]["prompt_tokens"]
    wanted = body["usage"]["completion_tokens"]
    assert wanted >= 64 * 3 * 4

    def counted() -> bool:
        got = usage_of(gateway.http_url, made["id"])
        # an answer whose end names no input (the fake's raw prompts) keeps the estimate
        return got["output_tokens"] == wanted and got["input_tokens"] in (
            body["usage"]["prompt_tokens"] or estimate_of(r),
        )

    asyncio.run(eventually(counted, timeout=5, what="every answer counted"))


@pytest.mark.parametrize("engine", ["busy", "context"])
def test_a_response_refused_after_admission_gives_its_estimate_back(
    make_gateway, redis_url, engine
) -> None:
    fake = FakeEngine(busy=True) if engine == "busy" else FakeEngine(context_tokens=20)
    gw = make_gateway(engine=fake, settings=dict(admin_api_key=ADMIN, redis_url=redis_url))
    fresh_minute(5.0)
    made = create(gw.http_url, input_tpm=BIG)
    headers = {"Authorization": f"Bearer {made['secret']}"}
    huge = chat_body(" ".join(f"w{i}" for i in range(3000)))
    r = httpx.post(f"{gw.http_url}/v1/chat/completions", json=huge, headers=headers)
    assert r.status_code in (400, 429, 503), r.text
    assert r.json()["error"]["code"] in ("busy", "context_length_exceeded")

    def given_back() -> bool:
        return usage_of(gw.http_url, made["id"])["requests"] == 1

    asyncio.run(eventually(given_back, timeout=5, what="the request counted"))
    # nothing of the refused one's estimate is left: a tiny request sees almost all the room
    ok = httpx.post(f"{gw.http_url}/v1/chat/completions", json=chat_body("hi"), headers=headers)
    left = int(ok.headers["x-ratelimit-remaining-tokens"])
    assert left > BIG - 100, left


def test_one_huge_prompt_is_owed_by_the_minutes_after_it(gateway) -> None:
    """A 3,000-token prompt against 1,000 input tokens a minute is let in (its minute had
    room) and owed by the minutes after it: the next request's Retry-After names when the key
    may send again, the start of the minute after next (the next one still owes more than a
    limit), not the end of this minute."""
    fresh_minute(5.0)
    made = create(gateway.http_url, input_tpm=1000)
    headers = {"Authorization": f"Bearer {made['secret']}"}
    url = f"{gateway.http_url}/v1/chat/completions"
    huge = httpx.post(
        url, json=chat_body(" ".join(f"w{i}" for i in range(3000)), max_tokens=1), headers=headers
    )
    assert huge.status_code == 200 and huge.json()["usage"]["prompt_tokens"] > 3000
    r = httpx.post(url, json=chat_body("hi"), headers=headers)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
    assert 60 < int(r.headers["retry-after"]) <= 120
    reset = r.headers["x-ratelimit-reset-tokens"]
    assert reset.startswith("1m") or reset == "2m0s", reset


async def test_realtime_clients_on_two_replicas_stay_within_the_limit_plus_one(
    slow_replicas,
) -> None:
    """Eight Realtime connections of one key, four on each replica, ask at once: what is
    admitted stays within the limit plus one response; the rest get `rate_limited`."""
    a, b = slow_replicas
    limit = 400
    fresh_minute(10.0)
    key = create(a.http_url, input_tpm=limit)["secret"]
    texts = [DENSE[i % 2] for i in range(8)]
    ends = await realtime_burst((a, b), key, texts, 1, timeout=10)
    real = [e["response"]["usage"]["input_tokens"] for e in ends if e["type"] == "response.done"]
    assert real and len(real) < len(ends)
    assert sum(real) < limit + max(real), (sum(real), real)


async def test_every_choice_of_a_chat_completion_is_counted(gateway) -> None:
    made = create(gateway.http_url, output_tpm=BIG)
    r = httpx.post(
        f"{gateway.http_url}/v1/chat/completions",
        json=chat_body("one two three four", n=3),
        headers={"Authorization": f"Bearer {made['secret']}"},
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    wanted = r.json()["usage"]["completion_tokens"]
    assert wanted >= 3 * 5  # each choice's words and its tag

    await eventually(
        lambda: usage_of(gateway.http_url, made["id"])["output_tokens"] == wanted,
        timeout=5,
        what="all three choices counted",
    )
