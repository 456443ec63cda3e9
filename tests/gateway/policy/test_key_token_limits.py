"""Token limits, rate-limit headers and token usage of managed keys over real gateways (the fake
engine and encoder) on a real redis-server: two replicas under concurrent clients held to the
limit plus one response, 429s with Retry-After and the `x-ratelimit-*` headers as the official
`openai` client reads them, on every HTTP API, Realtime `rate_limits.updated`, and the usage
counters (`/v1/admin/usage`, `/metrics`) after known requests."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import httpx
import openai
import pytest

from gateway.testing.fake_gateway import eventually
from gateway.testing.images import data_url, unique_photo
from gateway.testing.realtime_peer import Peer
from tests.gateway.api.admin.test_admin_keys import ADMIN, admin_headers, create

RESET = re.compile(r"^(\d+h)?(\d+m)?(\d+(\.\d+)?s|\d+ms)$")  # "1s", "6m0s", "20ms"


@pytest.fixture(params=["redis"])
def replicas(request, make_gateway):
    """Two gateways on one Redis (the concurrency test also runs them on a Redis Cluster)."""
    url = request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url")
    settings = dict(admin_api_key=ADMIN, redis_url=url)
    return make_gateway(settings=settings), make_gateway(settings=settings)


def fresh_minute(needed_s: float = 15.0) -> None:
    """Wait for the next minute when this one has less than `needed_s` left: a test of a
    per-minute limit must not see its window start again halfway."""
    left = 60.0 - time.time() % 60.0
    if left < needed_s:
        time.sleep(left + 0.05)


def usage_of(url: str, key_id: str) -> dict:
    data = httpx.get(f"{url}/v1/admin/usage", headers=admin_headers()).json()["data"]
    return next(u for u in data if u["id"] == key_id)


def assert_token_refusal(r: httpx.Response, limit: int) -> None:
    """A 429 of a token limit: the stable code, Retry-After and the token headers."""
    assert r.json()["error"]["code"] == "rate_limited"
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-ratelimit-remaining-tokens"] == "0"
    assert r.headers["x-ratelimit-limit-tokens"] == str(limit)
    assert RESET.match(r.headers["x-ratelimit-reset-tokens"])


def admitted_within(answers: list[httpx.Response], limit: int) -> list[httpx.Response]:
    """The answers of concurrent clients against an input limit: each a 200 or a token 429,
    some of both, and the prompt tokens admitted within the limit plus one response. The
    200s."""
    ok = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code == 429]
    assert len(ok) + len(refused) == len(answers), {r.status_code for r in answers}
    assert ok and refused
    prompt_tokens = [r.json()["usage"]["prompt_tokens"] for r in ok]
    assert sum(prompt_tokens) < limit + max(prompt_tokens)
    for r in refused:
        assert_token_refusal(r, limit)
    return ok


def chat_body(text: str, **extra) -> dict:
    return {"model": "fake-echo", "messages": [{"role": "user", "content": text}], **extra}


@pytest.mark.parametrize("replicas", ["redis", "cluster"], indirect=True)
async def test_two_replicas_hold_the_input_limit_under_concurrent_clients(replicas) -> None:
    a, b = replicas
    limit = 300
    fresh_minute()
    made = create(a.http_url, input_tpm=limit)
    key, key_id = made["secret"], made["id"]
    headers = {"Authorization": f"Bearer {key}"}
    prompt = "tell me about the photo of the cat on the mat please"

    async with httpx.AsyncClient(timeout=30) as client:

        async def one(i: int) -> httpx.Response:
            url = (a if i % 2 else b).http_url
            return await client.post(
                f"{url}/v1/chat/completions", json=chat_body(prompt), headers=headers
            )

        answers = []
        for _ in range(3):  # waves of concurrent clients on both replicas
            answers += await asyncio.gather(*(one(i) for i in range(24)))

    ok = admitted_within(answers, limit)
    prompt_tokens = [r.json()["usage"]["prompt_tokens"] for r in ok]
    # the counters hold what was really used: the admin API sees every admitted token
    completion_tokens = sum(r.json()["usage"]["completion_tokens"] for r in ok)

    def counted() -> bool:
        u = usage_of(b.http_url, key_id)
        return u["input_tokens"] == sum(prompt_tokens) and u["output_tokens"] == completion_tokens

    await eventually(counted, timeout=5, what="usage counted")


def test_429_and_headers_through_the_official_client(replicas) -> None:
    a, b = replicas
    fresh_minute()
    made = create(a.http_url, rpm=50, input_tpm=10)
    client = a.openai_client(api_key=made["secret"])
    raw = client.chat.completions.with_raw_response.create(
        model="fake-echo", messages=[{"role": "user", "content": "hello there"}]
    )
    assert raw.status_code == 200 and raw.parse().choices[0].message.content
    h = raw.headers
    assert h["x-ratelimit-limit-requests"] == "50"
    assert h["x-ratelimit-remaining-requests"] == "49"
    assert RESET.match(h["x-ratelimit-reset-requests"])
    assert h["x-ratelimit-limit-tokens"] == "10"
    # while it ran its estimate (over 10) held the room; the real count replaced it after
    assert h["x-ratelimit-remaining-tokens"] == "0"
    assert RESET.match(h["x-ratelimit-reset-tokens"])
    used = raw.parse().usage.prompt_tokens
    for _ in range(10 // used):  # the rest of the minute's room, in real tokens
        with contextlib.suppress(openai.RateLimitError):  # an estimate not corrected yet
            client.chat.completions.create(
                model="fake-echo", messages=[{"role": "user", "content": "hello there"}]
            )

    # the other replica, on every HTTP API: 429, Retry-After and the headers
    other = b.openai_client(api_key=made["secret"])
    calls = [
        lambda: other.chat.completions.with_raw_response.create(
            model="fake-echo", messages=[{"role": "user", "content": "again"}]
        ),
        lambda: other.responses.with_raw_response.create(model="fake-echo", input="again"),
        lambda: other.completions.with_raw_response.create(model="fake-echo", prompt="again"),
    ]
    for call in calls:
        with pytest.raises(openai.RateLimitError) as refused:
            call()
        response = refused.value.response
        assert response.status_code == 429
        assert refused.value.code == "rate_limited"
        assert 1 <= int(response.headers["retry-after"]) <= 60
        assert response.headers["x-ratelimit-remaining-tokens"] == "0"
        assert response.headers["x-ratelimit-limit-requests"] == "50"
    # a stream carries them on its start; a 429 of the request limit carries both kinds
    fresh_minute(10.0)
    two = create(a.http_url, rpm=2, output_tpm=1000)
    streamer = b.openai_client(api_key=two["secret"])
    with streamer.chat.completions.with_streaming_response.create(
        model="fake-echo", messages=[{"role": "user", "content": "hi"}], stream=True
    ) as stream:
        assert stream.headers["x-ratelimit-remaining-requests"] == "1"
        assert stream.headers["x-ratelimit-limit-tokens"] == "1000"
        assert "data: [DONE]" in "".join(stream.iter_lines())
    streamer.chat.completions.create(model="fake-echo", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.RateLimitError) as refused:
        streamer.chat.completions.create(
            model="fake-echo", messages=[{"role": "user", "content": "x"}]
        )
    h = refused.value.response.headers
    assert h["x-ratelimit-remaining-requests"] == "0" and int(h["retry-after"]) >= 1
    assert h["x-ratelimit-limit-tokens"] == "1000"
    assert int(h["x-ratelimit-remaining-tokens"]) < 1000  # two answers counted
    # a key without limits, and a request no admission saw, carry no such headers
    plain = create(a.http_url)
    raw = a.openai_client(api_key=plain["secret"]).models.with_raw_response.list()
    assert not any(k.startswith("x-ratelimit") for k in raw.headers)


async def test_realtime_rate_limits_updated_after_each_response(replicas) -> None:
    a, _ = replicas
    fresh_minute(20.0)
    made = create(a.http_url, rpm=100, output_tpm=1000)
    async with Peer.connected(a.ws_url, api_key=made["secret"], key_in="header") as peer:
        for n in (1, 2):
            await peer.add([{"type": "input_text", "text": "one two three"}])
            await peer.until("conversation.item.done")
            done, _ = await peer.respond()
            output = done["response"]["usage"]["output_tokens"]
            event = await peer.recv(timeout=10)
            assert event["type"] == "rate_limits.updated" and event["event_id"]
            limits = {x["name"]: x for x in event["rate_limits"]}
            assert limits["requests"]["limit"] == 100
            assert limits["requests"]["remaining"] == 100 - n
            assert 0 < limits["requests"]["reset_seconds"] <= 60
            assert limits["tokens"]["limit"] == 1000
            assert limits["tokens"]["remaining"] == 1000 - n * output
    # past its limit, response.create is refused with the error event, and nothing runs
    tight = create(a.http_url, output_tpm=3)
    async with Peer.connected(a.ws_url, api_key=tight["secret"], key_in="header") as peer:
        await peer.add([{"type": "input_text", "text": "one two three four five"}])
        await peer.until("conversation.item.done")
        done, _ = await peer.respond()
        assert done["response"]["usage"]["output_tokens"] > 3
        assert (await peer.recv(timeout=10))["type"] == "rate_limits.updated"
        await peer.send({"type": "response.create", "event_id": "evt_again"})
        error = await peer.recv(timeout=10)
        assert error["type"] == "error" and error["error"]["code"] == "rate_limited"
        assert error["error"]["event_id"] == "evt_again"
        assert "3 output tokens per minute" in error["error"]["message"]
        # the connection stays open and the conversation is as it was
        await peer.send({"type": "conversation.item.retrieve", "item_id": "nope"})
        assert (await peer.recv(timeout=10))["error"]["code"] == "item_not_found"
    # a key with no limits gets no such event
    plain = create(a.http_url)
    async with Peer.connected(a.ws_url, api_key=plain["secret"], key_in="header") as peer:
        await peer.add([{"type": "input_text", "text": "hi"}])
        await peer.until("conversation.item.done")
        await peer.respond()
        await peer.send({"type": "conversation.item.retrieve", "item_id": "nope"})
        assert (await peer.recv(timeout=10))["type"] == "error"


async def test_usage_after_known_requests(replicas) -> None:
    a, b = replicas
    made = create(a.http_url)
    key, key_id = made["secret"], made["id"]
    client = b.openai_client(api_key=key)
    first = client.chat.completions.create(**chat_body("one two three four"))
    photo = data_url(unique_photo())
    second = client.chat.completions.create(
        model="fake-echo",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this"},
                    {"type": "image_url", "image_url": {"url": photo}},
                ],
            }
        ],
    )
    raw = client.completions.create(model="fake-echo", prompt="five six")
    answers = [first.usage, second.usage, raw.usage]
    want_in = sum(u.prompt_tokens for u in answers)
    want_out = sum(u.completion_tokens for u in answers)

    def counted() -> bool:
        return usage_of(a.http_url, key_id)["requests"] == 3

    await eventually(counted, timeout=5, what="three requests counted")
    await eventually(
        lambda: usage_of(a.http_url, key_id)["output_tokens"] == want_out,
        timeout=5,
        what="tokens counted",
    )
    got = usage_of(a.http_url, key_id)
    assert got["input_tokens"] == want_in
    # the same for today's period; nothing in another
    today = time.strftime("%Y-%m-%d", time.gmtime())
    page = httpx.get(
        f"{a.http_url}/v1/admin/usage", params={"start": today}, headers=admin_headers()
    ).json()
    assert page["start"] == page["end"] == today
    assert next(u for u in page["data"] if u["id"] == key_id) == got
    page = httpx.get(
        f"{a.http_url}/v1/admin/usage",
        params={"start": "2020-01-01", "end": "2020-01-31"},
        headers=admin_headers(),
    ).json()
    assert next(u for u in page["data"] if u["id"] == key_id)["input_tokens"] == 0
    for bad in (
        {"start": "2020-1-1"},
        {"start": "yesterday"},
        {"end": "2020-01-01"},
        {"start": "2020-02-01", "end": "2020-01-01"},
        {"start": "2020-01-01", "end": "2020-12-31"},  # over 92 days
    ):
        r = httpx.get(f"{a.http_url}/v1/admin/usage", params=bad, headers=admin_headers())
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", bad
    assert got["image_tokens"] > 0  # the photo's visual tokens
    assert got["image_tokens"] < got["input_tokens"]
    assert got["cached_tokens"] >= 0 and got["encode_ms"] >= 0
    # the replica that served them exports them labelled by the key's id
    metrics = httpx.get(f"{b.http_url}/metrics").text
    line = f'visiongate_key_tokens_total{{key="{key_id}",type="input"}} {float(want_in)}'
    assert line in metrics, [m for m in metrics.splitlines() if "key_tokens" in m]
    assert f'visiongate_key_tokens_total{{key="{key_id}",type="output"}}' in metrics


async def test_an_abandoned_stream_counts_what_it_streamed(make_gateway, redis_url) -> None:
    from gateway.testing.fakes import FakeEngine

    gw = make_gateway(
        engine=FakeEngine(delay_s=0.05), settings=dict(admin_api_key=ADMIN, redis_url=redis_url)
    )
    made = create(gw.http_url, output_tpm=100_000)
    words = " ".join(f"w{i}" for i in range(25))
    headers = {"Authorization": f"Bearer {made['secret']}"}
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream(
            "POST",
            f"{gw.http_url}/v1/chat/completions",
            json=chat_body(words, stream=True, max_tokens=30),
            headers=headers,
        ) as stream,
    ):
        seen = 0
        async for line in stream.aiter_lines():
            seen += bool(re.search(r'"content":"[^"]', line))  # a text delta
            if seen >= 4:
                break  # the client goes away mid-answer
    await eventually(
        lambda: usage_of(gw.http_url, made["id"])["output_tokens"] >= 4,
        timeout=5,
        what="the streamed tokens counted",
    )
    got = usage_of(gw.http_url, made["id"])
    # what streamed before the close was seen, not the 26 tokens of the whole answer
    assert got["requests"] == 1 and got["output_tokens"] < 26
    assert got["input_tokens"] > 0  # its estimate stands: no end brought the real count
