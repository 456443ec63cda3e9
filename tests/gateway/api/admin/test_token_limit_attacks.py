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
from tests.gateway.api.admin.test_key_token_limits import chat_body, fresh_minute, usage_of

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


async def test_concurrent_dense_prompts_stay_within_the_limit_plus_one(make_gateway, redis_url):
    settings = dict(admin_api_key=ADMIN, redis_url=redis_url)
    # slow enough that every client is admitted before any answer's real count lands
    a = make_gateway(engine=FakeEngine(delay_s=0.3), settings=settings)
    b = make_gateway(engine=FakeEngine(delay_s=0.3), settings=settings)
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
