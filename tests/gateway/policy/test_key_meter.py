"""The per-response token meter over real parts (the memory key store and token limiter, an
Authenticator that has read the key, the gateway's metrics): the estimate counted at
admission and corrected at the end, streamed output written in batches, refusals, a response
that never finishes, usage in the store and the key label's bound."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from gateway.policy.auth import Authenticator
from gateway.policy.key_store import (
    KeyRecord,
    MemoryKeyStore,
    new_key_id,
    new_secret,
    secret_digest,
)
from gateway.policy.key_usage import (
    CHARGE_EVERY,
    KEY_LABELS,
    CountingLimiter,
    TokenMeter,
    TokenUsage,
)
from gateway.policy.ratelimit import MemoryRateLimiter
from gateway.policy.token_limits import MemoryTokenLimiter, TokenLimits
from gateway.telemetry import Telemetry, config_from_env


async def managed(auth: Authenticator, store: MemoryKeyStore, **limits) -> str:
    secret = new_secret()
    record = KeyRecord(id=new_key_id(), name="n", created=time.time(), **limits)
    await store.create(record, secret_digest(secret))
    assert await auth.lookup(secret) == record  # now `limits_of` knows it
    return record.id


def samples(t: Telemetry) -> dict[tuple[str, tuple], float]:
    body, _ = t.prometheus_text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


async def test_a_response_counted_from_admission_to_its_end() -> None:
    store, limiter = MemoryKeyStore(), MemoryTokenLimiter()
    auth = Authenticator([], store)
    telemetry = Telemetry(config_from_env({}), "test")
    meter = TokenMeter(limiter, auth, telemetry.metrics)
    key = await managed(auth, store, input_tpm=100, output_tpm=1000)
    limits = TokenLimits(input_tpm=100, output_tpm=1000)

    assert meter.open("key_static_or_anonymous") is None  # only managed keys are metered
    metered = meter.open(key)
    assert await metered.admit(80) is None
    assert (await limiter.admit(key, limits, 0)).input == 80  # the estimate, at once
    for _ in range(CHARGE_EVERY - 1):
        metered.streamed()
    await meter._background.settled(key)
    assert (await limiter.admit(key, limits, 0)).output == 0  # not a batch yet
    metered.streamed()
    await meter._background.settled(key)
    assert (await limiter.admit(key, limits, 0)).output == CHARGE_EVERY
    metered.finish(TokenUsage(input_tokens=30, cached_tokens=10, output_tokens=20, image_tokens=5))
    metered.close()  # after a finish: nothing more
    await meter._background.settled(key)
    used = await limiter.admit(key, limits, 0)
    assert (used.input, used.output) == (30, 20)  # the real counts replaced the estimate
    (usage,) = await store.usage([key])
    assert (usage.input_tokens, usage.cached_tokens, usage.output_tokens) == (30, 10, 20)
    assert usage.image_tokens == 5

    # a second one takes the room that is left (30 < 100); a third finds none
    second = meter.open(key)
    assert await second.admit(90) is None
    third = meter.open(key)
    refused = await third.admit(1)
    assert refused is not None and refused.code == "rate_limited" and refused.retry_after_s
    third.close()  # refused: nothing counted for it
    second.streamed(3)
    second.close()  # it never finished: its estimate and what it streamed stay counted
    await meter._background.settled(key)
    used = await limiter.admit(key, limits, 0)
    assert (used.input, used.output) == (120, 23)
    (usage,) = await store.usage([key])
    assert (usage.input_tokens, usage.output_tokens) == (120, 23)

    rows = samples(telemetry)
    assert rows[("visiongate_key_tokens_total", (("key", key), ("type", "input")))] == 120
    assert rows[("visiongate_key_tokens_total", (("key", key), ("type", "cached")))] == 10
    assert rows[("visiongate_key_rate_limited_total", (("key", key), ("limit", "tokens")))] == 1
    await meter.aclose()


async def test_key_labels_are_bounded() -> None:
    meter = TokenMeter(MemoryTokenLimiter(), Authenticator([], MemoryKeyStore()))
    ids = [new_key_id() for _ in range(KEY_LABELS + 5)]
    labels = [meter.key_label(k) for k in ids]
    assert labels[:KEY_LABELS] == ids[:KEY_LABELS]
    assert labels[KEY_LABELS:] == ["other"] * 5
    assert meter.key_label(ids[0]) == ids[0]  # a labelled key keeps its label


async def test_a_response_refused_at_its_admission_is_not_a_request_of_its_key() -> None:
    """Two responses pass the request limiter while the key's minute has room; the first one's
    estimate takes it all, so the second is refused when its own estimate is counted. Its
    request was counted on the way in; the key's usage counts one request, not two."""
    store, limiter = MemoryKeyStore(), MemoryTokenLimiter()
    auth = Authenticator([], store)
    meter = TokenMeter(limiter, auth)
    requests = CountingLimiter(MemoryRateLimiter(0), auth, meter)
    key = await managed(auth, store, input_tpm=100)
    await requests.acquire(key)
    await requests.acquire(key)
    first, second = meter.open(key), meter.open(key)
    assert await first.admit(150) is None
    refused = await second.admit(10)
    assert refused is not None and refused.code == "rate_limited"
    first.finish(TokenUsage(input_tokens=150, output_tokens=1))
    await requests._background.drain()
    await meter._background.settled(key)
    (usage,) = await store.usage([key])
    assert (usage.requests, usage.input_tokens) == (1, 150)
    await requests.aclose()
