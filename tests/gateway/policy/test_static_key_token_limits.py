"""Token limits of static keys (`input_tokens_per_minute`, `output_tokens_per_minute`) over real
gateways (the fake engine and encoder) on a real redis-server: two replicas under concurrent
clients held to the limit plus one response, per key (one key's tokens never spend another's),
the `x-ratelimit-*-tokens` headers as the official `openai` client reads them, and a managed
key keeping its own limits beside them."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.gateway.api.admin.test_admin_keys import ADMIN, create
from tests.gateway.policy.test_key_token_limits import (
    RESET,
    admitted_within,
    chat_body,
    fresh_minute,
)

ALICE, BOB = "sk-alice-4f1e9a27c3d85b60", "sk-bob-8d2c6e1f0a9b7345"
LIMIT = 300


@pytest.fixture
def replicas(make_gateway, redis_url):
    settings = dict(
        api_keys=[ALICE, BOB],
        admin_api_key=ADMIN,
        redis_url=redis_url,
        input_tokens_per_minute=LIMIT,
        output_tokens_per_minute=100_000,
    )
    return make_gateway(settings=settings), make_gateway(settings=settings)


async def test_two_replicas_hold_a_static_keys_input_limit(replicas) -> None:
    a, b = replicas
    fresh_minute()
    prompt = "tell me about the photo of the cat on the mat please"

    async with httpx.AsyncClient(timeout=30) as client:

        async def one(i: int, key: str) -> httpx.Response:
            url = (a if i % 2 else b).http_url
            return await client.post(
                f"{url}/v1/chat/completions",
                json=chat_body(prompt),
                headers={"Authorization": f"Bearer {key}"},
            )

        answers = []
        for _ in range(3):  # waves of concurrent clients on both replicas
            answers += await asyncio.gather(*(one(i, ALICE) for i in range(24)))
        # Alice's minute is spent: Bob's is his own
        bob = await one(0, BOB)

    admitted_within(answers, LIMIT)
    assert bob.status_code == 200, bob.text
    # their metrics name them by position, never by the hash of the key
    metrics = "\n".join(httpx.get(f"{gw.http_url}/metrics").text for gw in (a, b))
    assert 'key="static-1"' in metrics and 'key="static-2"' in metrics
    assert not any(
        'key="key_' in row for row in metrics.splitlines() if row.startswith("visiongate_key_")
    )


def test_headers_through_the_official_client_and_a_managed_keys_own_limits(replicas) -> None:
    a, b = replicas
    fresh_minute()
    client = a.openai_client(api_key=BOB)
    raw = client.chat.completions.with_raw_response.create(
        model="fake-echo", messages=[{"role": "user", "content": "hello there"}]
    )
    assert raw.status_code == 200 and raw.parse().choices[0].message.content
    assert raw.headers["x-ratelimit-limit-tokens"] == str(LIMIT)
    assert 0 <= int(raw.headers["x-ratelimit-remaining-tokens"]) < LIMIT
    assert RESET.match(raw.headers["x-ratelimit-reset-tokens"])
    # a managed key's limits are its own, not the static keys' defaults
    managed = create(a.http_url, input_tpm=5)
    other = b.openai_client(api_key=managed["secret"])
    raw = other.responses.with_raw_response.create(model="fake-echo", input="again " * 10)
    assert raw.headers["x-ratelimit-limit-tokens"] == "5"
    with pytest.raises(openai.RateLimitError) as refused:
        other.completions.create(model="fake-echo", prompt="once more")
    assert refused.value.response.headers["x-ratelimit-limit-tokens"] == "5"
    unlimited = create(a.http_url)  # a managed key that sets no token limit has none
    raw = a.openai_client(api_key=unlimited["secret"]).chat.completions.with_raw_response.create(
        model="fake-echo", messages=[{"role": "user", "content": "hi"}]
    )
    assert "x-ratelimit-limit-tokens" not in raw.headers


def test_a_gateway_without_keys_limits_all_callers_together(make_gateway) -> None:
    gw = make_gateway(settings=dict(input_tokens_per_minute=20))
    fresh_minute()
    client = gw.openai_client(api_key="anything")
    codes = []
    for _ in range(6):
        try:
            client.chat.completions.create(
                model="fake-echo", messages=[{"role": "user", "content": "a few words to count"}]
            )
            codes.append(200)
        except openai.RateLimitError as exc:
            codes.append(429)
            assert exc.response.headers["x-ratelimit-limit-tokens"] == "20"
    assert codes[0] == 200 and 429 in codes, codes
    # their usage is counted in the metrics, as one owner's
    metrics = httpx.get(f"{gw.http_url}/metrics").text
    (line,) = [
        row
        for row in metrics.splitlines()
        if row.startswith("visiongate_key_tokens_total{") and 'type="input"' in row
    ]
    assert 'key="anonymous"' in line and float(line.rsplit(" ", 1)[1]) >= 5
