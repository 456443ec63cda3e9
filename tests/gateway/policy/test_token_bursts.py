"""Bursts against the token limits and the cap on responses in flight, over real gateways (the
fake engine, which echoes the question a word a token) with the official `openai` client: one
gateway on the memory backend, and two replicas sharing a real redis-server or a real Redis
Cluster. Each response reserves the most output it may write when it is admitted, so a
parallel burst stays within the limit plus one response's reservation (only the input used to
be counted: every parallel request found output room); what a short answer did not use is
given back, so the key's next request is let in; a key's responses in flight are capped."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from gateway.testing.fakes import FakeEngine
from gateway.testing.realtime_peer import Peer
from tests.gateway.api.admin.test_admin_keys import ADMIN, create
from tests.gateway.policy.test_key_token_limits import chat_body, fresh_minute

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma"]


def words(n: int) -> str:
    """A prompt of `n` words without digits: the fake answers with them, one token each."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(n))


@pytest.fixture(params=["memory", "redis", "cluster"])
def pair(request, make_gateway):
    """Where a burst lands: one gateway on the memory backend (twice), or two replicas on one
    Redis or Redis Cluster. Answers take a few seconds, so the whole burst is admitted (or
    refused) while the first answers are still under way."""
    settings: dict = dict(admin_api_key=ADMIN)
    if request.param != "memory":
        url = "redis_url" if request.param == "redis" else "redis_cluster_url"
        settings["redis_url"] = request.getfixturevalue(url)
    a = make_gateway(engine=FakeEngine(delay_s=0.02), settings=settings)
    b = (
        a
        if request.param == "memory"
        else make_gateway(engine=FakeEngine(delay_s=0.02), settings=settings)
    )
    return a, b


async def burst(pair, key: str, count: int, call) -> tuple[list, list[openai.RateLimitError]]:
    """`count` calls at once through the official client, alternating between the replicas:
    (the answers, the 429s)."""
    a, b = pair
    clients = [
        openai.AsyncOpenAI(base_url=f"{g.http_url}/v1", api_key=key, max_retries=0, timeout=60)
        for g in (a, b)
    ]
    try:
        results = await asyncio.gather(
            *(call(clients[i % 2]) for i in range(count)), return_exceptions=True
        )
    finally:
        for client in clients:
            await client.close()
    answers = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(answers) + len(refused) == count, [r for r in results if isinstance(r, Exception)]
    return answers, refused


def assert_token_refusals(refused: list[openai.RateLimitError], limit: int) -> None:
    assert refused, "nothing was refused"
    for error in refused:
        assert error.code == "rate_limited", error
        headers = error.response.headers
        assert int(headers["retry-after"]) >= 1
        assert headers["x-ratelimit-remaining-tokens"] == "0"
        assert headers["x-ratelimit-limit-tokens"] == str(limit)


async def test_twenty_parallel_chat_completions_stay_within_the_output_limit(pair) -> None:
    """20 parallel chat completions of 100 output tokens each on a key of 100 output tokens a
    minute: all 20 were admitted (2,000 tokens). Now the first reserves its 100 and the others
    are refused while it runs."""
    a, _ = pair
    limit, max_tokens = 100, 100
    fresh_minute(20.0)
    key = create(a.http_url, output_tpm=limit)["secret"]

    async def call(client: openai.AsyncOpenAI):
        return await client.chat.completions.create(
            model="fake-echo",
            messages=[{"role": "user", "content": words(120)}],
            max_tokens=max_tokens,
        )

    answers, refused = await burst(pair, key, 20, call)
    written = sum(r.usage.completion_tokens for r in answers)
    assert answers and written <= limit + max_tokens, (written, len(answers))
    assert_token_refusals(refused, limit)


@pytest.mark.parametrize("api", ["responses", "completions"])
async def test_parallel_responses_and_completions_stay_within_the_output_limit(
    make_gateway, redis_url, api
) -> None:
    settings = dict(admin_api_key=ADMIN, redis_url=redis_url)
    pair = tuple(make_gateway(engine=FakeEngine(delay_s=0.02), settings=settings) for _ in "ab")
    limit, max_tokens = 100, 60
    fresh_minute(20.0)
    key = create(pair[0].http_url, output_tpm=limit)["secret"]

    async def call(client: openai.AsyncOpenAI):
        if api == "responses":
            return await client.responses.create(
                model="fake-echo", input=words(100), max_output_tokens=max_tokens
            )
        return await client.completions.create(
            model="fake-echo", prompt=words(100), max_tokens=max_tokens
        )

    answers, refused = await burst(pair, key, 20, call)
    written = [
        r.usage.output_tokens if api == "responses" else r.usage.completion_tokens for r in answers
    ]
    assert answers and sum(written) <= limit + max_tokens, written
    assert_token_refusals(refused, limit)


async def test_thirty_parallel_requests_stay_within_a_daily_budget(pair) -> None:
    """30 parallel requests, 8 answers of up to 21 tokens each, on a key of 1,000 tokens a day:
    counting only the input let all 30 in (about 5,700 tokens). Now what is admitted, input
    and output, stays within the budget plus one response's admission (its estimate and its
    reservation, read off a lone request's headers)."""
    a, _ = pair
    budget, n, max_tokens = 1000, 8, 21
    body = dict(messages=[{"role": "user", "content": words(20)}], max_tokens=max_tokens, n=n)
    probe = create(a.http_url, budget_tokens=10**9, budget_period="day")["secret"]
    lone = a.openai_client(api_key=probe).chat.completions.with_raw_response.create(
        model="fake-echo", **body
    )
    one = 10**9 - int(lone.headers["x-ratelimit-remaining-tokens"])
    key = create(a.http_url, budget_tokens=budget, budget_period="day")["secret"]

    async def call(client: openai.AsyncOpenAI):
        return await client.chat.completions.create(model="fake-echo", **body)

    answers, refused = await burst(pair, key, 30, call)
    used = sum(r.usage.prompt_tokens + r.usage.completion_tokens for r in answers)
    assert answers and used <= budget + one, (used, len(answers), one)
    assert one >= n * max_tokens  # the reservation was counted at admission
    assert_token_refusals(refused, budget)


async def test_a_short_answer_gives_its_reservation_back(pair) -> None:
    """A key of 100 output tokens a minute asks for up to 100 and gets 4, eight times in a row,
    each next request sent at once to the other replica: each is admitted (what the one before
    gave back was written before its client heard of its end), and the headers count what
    was written, not what was reserved."""
    a, b = pair
    fresh_minute(10.0)
    key = create(a.http_url, output_tpm=100)["secret"]
    for i in range(8):
        client = (a, b)[i % 2].openai_client(api_key=key)
        raw = client.chat.completions.with_raw_response.create(
            model="fake-echo",
            messages=[{"role": "user", "content": "one two three"}],
            max_tokens=100,
        )
        assert raw.status_code == 200
        assert raw.parse().usage.completion_tokens == 4
    # admitted with 100 reserved on top of the 28 written before it
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) == 0
    peek = a.openai_client(api_key=key).chat.completions.with_raw_response.create(
        model="fake-echo", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert int(peek.headers["x-ratelimit-remaining-tokens"]) == 100 - 8 * 4 - 1


async def test_a_stream_given_up_by_its_client_gives_back_what_it_did_not_write(
    make_gateway, redis_url
) -> None:
    gw = make_gateway(
        engine=FakeEngine(delay_s=0.05), settings=dict(admin_api_key=ADMIN, redis_url=redis_url)
    )
    fresh_minute(15.0)
    key = create(gw.http_url, output_tpm=200)["secret"]
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream(
            "POST",
            f"{gw.http_url}/v1/chat/completions",
            json=chat_body(words(100), stream=True, max_tokens=150),
            headers=headers,
        ) as stream:
            seen = 0
            async for line in stream.aiter_lines():
                seen += '"content":"' in line and '"content":""' not in line
                if seen >= 5:
                    break
        # the reservation (150) is given back but for what streamed: room for another
        for _ in range(50):
            r = await client.post(
                f"{gw.http_url}/v1/chat/completions",
                json=chat_body("hi", max_tokens=150),
                headers=headers,
            )
            if r.status_code == 200:
                break
            await asyncio.sleep(0.1)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_the_cap_on_a_keys_responses_in_flight(make_gateway, backend, request) -> None:
    """A static key capped at 2 responses in flight, and a managed key whose own cap is 1,
    each sending 6 at once (over two replicas on Redis): the cap's worth run, the rest get
    429 `concurrency_limited` with Retry-After, and once they end the key is let in again."""
    static = "sk-burst-static-0123456789"
    settings: dict = dict(
        admin_api_key=ADMIN, api_keys=[static], max_concurrent_responses_per_key=2
    )
    if backend == "redis":
        settings["redis_url"] = request.getfixturevalue("redis_url")
    a = make_gateway(engine=FakeEngine(delay_s=0.05), settings=settings)
    b = (
        a
        if backend == "memory"
        else make_gateway(engine=FakeEngine(delay_s=0.05), settings=settings)
    )
    managed = create(a.http_url, max_concurrent=1)
    assert managed["max_concurrent"] == 1
    for key, cap in ((static, 2), (managed["secret"], 1)):

        async def call(client: openai.AsyncOpenAI):
            return await client.chat.completions.create(
                model="fake-echo", messages=[{"role": "user", "content": words(30)}]
            )

        answers, refused = await burst((a, b), key, 6, call)
        assert len(answers) == cap, (len(answers), cap)
        for error in refused:
            assert error.code == "concurrency_limited"
            assert int(error.response.headers["retry-after"]) >= 1
        again = a.openai_client(api_key=key).chat.completions.create(
            model="fake-echo", messages=[{"role": "user", "content": "again"}]
        )
        assert again.choices[0].message.content


async def realtime_burst(
    replicas, key: str, texts: list[str], max_tokens: int, *, timeout: float
) -> list[dict]:
    """One Realtime connection of `key` per text, alternating between the two `replicas`, each
    given its text as an item; then all ask for a response of up to `max_tokens` at once. Each
    one's end: its `response.done` (not failed), or its `rate_limited` error."""
    a, b = replicas
    peers = [
        await Peer.open((a if i % 2 else b).ws_url, api_key=key, key_in="header")
        for i in range(len(texts))
    ]
    try:
        for peer, text in zip(peers, texts, strict=True):
            await peer.add([{"type": "input_text", "text": text}])
            await peer.until("conversation.item.done", timeout=10)

        async def ask(peer: Peer) -> dict:
            await peer.send(
                {"type": "response.create", "response": {"max_output_tokens": max_tokens}}
            )
            while True:
                event = await peer.recv(timeout=timeout)
                if event["type"] == "response.done" and event["response"]["status"] != "failed":
                    return event
                if event["type"] == "error":
                    assert event["error"]["code"] == "rate_limited", event
                    return event

        return await asyncio.gather(*(ask(p) for p in peers))
    finally:
        for peer in peers:
            await peer.close()


async def test_realtime_responses_on_two_replicas_reserve_their_output(make_gateway, redis_url):
    """Eight Realtime connections of one key, four on each replica, each asking for up to 60
    tokens of a 100-word answer at once: the output admitted stays within the limit plus one
    response's reservation; the rest get `rate_limited`."""
    settings = dict(admin_api_key=ADMIN, redis_url=redis_url)
    a, b = (make_gateway(engine=FakeEngine(delay_s=0.02), settings=settings) for _ in "ab")
    limit, max_tokens = 100, 60
    fresh_minute(20.0)
    key = create(a.http_url, output_tpm=limit)["secret"]
    ends = await realtime_burst((a, b), key, [words(100)] * 8, max_tokens, timeout=30)
    written = [
        e["response"]["usage"]["output_tokens"] for e in ends if e["type"] == "response.done"
    ]
    assert written and len(written) < len(ends)
    assert sum(written) <= limit + max_tokens, written
