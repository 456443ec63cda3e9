"""Adaptive visual budget: the cap follows the TTFT objective's burn; tokens made under a cap
are keyed by its fingerprint and found again whatever the budget is later.

The encoder is the real in-process one (seeded synthetic tower, dynamic pruning) on real
photos; the vision cache and image store are the memory tiers."""

from __future__ import annotations

import pytest

from encoder_worker.config import EncoderConfig
from encoder_worker.local_encoder import LocalEncoder
from encoder_worker.pipeline import budget_config
from gateway.caching import make_image_store, make_vision_cache
from gateway.chat.image_input import digest_of
from gateway.chat.vision_resolver import VisionResolver
from gateway.chat.visual_budget import BudgetedEncoder, VisualBudget
from gateway.testing.clock import ManualClock
from gateway.testing.images import data_url
from tests.conftest import photo_bytes

MiB = 1024 * 1024


def budget(clock: ManualClock, **kw) -> VisualBudget:
    args = dict(objective_ms=1000.0, ceiling=0.5, floor=0.2, step=0.1, window_s=10.0, hold_s=2.0)
    args.update(kw)
    return VisualBudget(min_samples=4, clock=clock, **args)  # type: ignore[arg-type]


def test_the_cap_steps_down_while_burning_and_back_once_it_stops() -> None:
    clock = ManualClock()
    b = budget(clock)
    assert b.levels == (0.5, 0.4, 0.3, 0.2) and b.cap is None
    for _ in range(3):
        b.observe(1500)
    assert b.cap is None  # too few samples to judge
    b.observe(1500)
    assert b.cap == 0.4 and b.in_force == 0.4
    for _ in range(4):  # burning on, but the step has not had time to show
        clock.now += 0.1
        b.observe(1500)
    assert b.cap == 0.4
    for _ in range(3):  # a step at a time, each after hold_s, down to the floor
        clock.now += 2.5
        for _ in range(4):
            b.observe(1500)
    assert b.cap == 0.2
    clock.now += 2.5
    for _ in range(4):
        b.observe(1500)
    assert b.cap == 0.2  # never below the floor
    clock.now += 11  # the burning samples leave the window
    for level in (0.3, 0.4, None):  # the burn stopped: back a step at a time
        clock.now += 2.5
        for _ in range(4):
            b.observe(300)
        assert b.cap == level
    clock.now += 30  # old samples leave the window
    assert b.p95_ms() is None


def test_bad_budgets_are_refused() -> None:
    clock = ManualClock()
    for kw in ({"floor": 0.0}, {"floor": 0.6}, {"step": 0.0}, {"objective_ms": 0.0}):
        with pytest.raises(ValueError):
            budget(clock, **kw)


def test_a_cap_is_other_content() -> None:
    config = EncoderConfig()
    assert budget_config(config, None) is config
    assert budget_config(config, 0.9) is config  # above every ratio: the same tokens
    capped = budget_config(config, 0.2)
    assert capped.max_keep_ratio == 0.2 and capped.keep_ratio == 0.2
    assert capped.min_keep_ratio == min(config.min_keep_ratio, 0.2)
    assert budget_config(EncoderConfig(pruning="none"), 0.2).pruning == "none"


async def test_images_encoded_under_a_cap_are_cached_by_its_fingerprint() -> None:
    inner = LocalEncoder(EncoderConfig(), hidden_size=576, target_rms=1.0)
    clock = ManualClock()
    b = budget(clock, ceiling=0.5, floor=0.1, step=0.2, hold_s=0.0)
    encoder = BudgetedEncoder(inner, b)
    assert encoder.fingerprints[0] == inner.fingerprint
    assert len(set(encoder.fingerprints)) == len(b.levels) == 3
    await encoder.start()
    try:
        vision = VisionResolver(
            encoder, make_vision_cache(None, 64 * MiB, 3600), make_image_store(None, 64 * MiB, 3600)
        )
        full_photo, small_photo = photo_bytes("astronaut"), photo_bytes("coffee")
        for data in (full_photo, small_photo):
            await vision.add("k", digest_of(data), data)
        full = await vision.resolve("k", digest_of(full_photo))
        assert full.image.fingerprint == inner.fingerprint
        for _ in range(8):  # the objective burns: two steps down, to the floor
            b.observe(5000)
        assert b.cap == 0.1
        small = await vision.resolve("k", digest_of(small_photo))
        assert small.source == "encoded"
        assert small.image.fingerprint == inner.fingerprint_for(0.1) != inner.fingerprint
        assert small.image.tokens_kept <= round(0.1 * small.image.tokens_total) + 1
        assert small.image.tokens_kept < full.image.tokens_kept
        for _ in range(8):  # the burn stops: the budget returns
            b.observe(10)
        assert b.cap is None
        # each image keeps the tokens it was first encoded with, found under its budget's key
        again = await vision.resolve("k", digest_of(small_photo))
        assert again.source == "memory" and again.image.tokens_kept == small.image.tokens_kept
        assert (await vision.resolve("k", digest_of(full_photo))).source == "memory"
        assert vision.encodes == 2
    finally:
        await encoder.aclose()


@pytest.mark.slow
def test_a_gateway_over_its_objective_encodes_new_images_smaller() -> None:
    """Served for real: TTFTs over a 1 ms objective lower the cap; the turn reports it."""
    import httpx

    from gateway.server.app import create_app
    from gateway.server.runner import ServerThread
    from tests.gateway.conftest import gateway_settings

    settings = gateway_settings(visual_budget_adaptive=True, visual_budget_ttft_ms=1.0)
    with ServerThread(create_app(settings), settings) as server:
        server.wait_ready()
        with httpx.Client(base_url=server.http_url, timeout=120) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]

            def ask(content) -> dict:
                body = {
                    "model": model,
                    "max_tokens": 1,
                    "messages": [{"role": "user", "content": content}],
                }
                reply = client.post("/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
                return reply.json()["usage"]["visiongate"]

            first = ask("Hi")
            assert first["cache"]["visual_budget"] == 0.5  # the configured cap, in force
            for i in range(8):
                ask(f"Say {i}.")
            url = data_url(photo_bytes("rocket"))
            turn = ask(
                [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is it?"},
                ]
            )
            assert turn["cache"]["visual_budget"] == 0.4
            assert turn["image_tokens"] <= round(0.4 * turn["image_tokens_total"]) + 1
            metrics = client.get("/metrics").text
            assert 'visiongate_encode_budget_total{keep_ratio_cap="0.4"' in metrics
