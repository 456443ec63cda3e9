from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from encoder_worker import EncodedImage, Encoder, EncoderConfig, ImageError, LocalEncoder
from encoder_worker.pipeline import encoder_fingerprint

STAGES = {"decode", "preprocess", "vision", "prune", "quantize"}


def _config(tiny_clip_dir: str, **kw) -> EncoderConfig:
    kw.setdefault("max_wait_ms", 200.0)
    kw.setdefault("cpu_batch", 8)  # the batching itself, on this CPU
    return EncoderConfig(tower=tiny_clip_dir, **kw)


async def test_concurrent_calls_are_encoded_as_one_batch(tiny_clip_dir, photos):
    enc = LocalEncoder(_config(tiny_clip_dir), hidden_size=48)
    await enc.start()
    try:
        assert isinstance(enc, Encoder)
        datas = list(photos.values())
        results = await asyncio.gather(*(enc.encode(d) for d in datas))
        assert enc.batches == 1
        for r, d in zip(results, datas, strict=False):
            assert isinstance(r, EncodedImage)
            assert r.timings_ms["batch_size"] == len(datas)
            assert r.timings_ms.keys() >= STAGES
            assert r.fingerprint == enc.fingerprint and r.hidden_size == 48
            assert r.embeds().shape == (r.tokens_kept, 48)
        assert len({r.digest for r in results}) == len(datas)
    finally:
        await enc.aclose()


async def test_one_bad_image_fails_only_its_caller(tiny_clip_dir, photos):
    enc = LocalEncoder(_config(tiny_clip_dir), hidden_size=48)
    await enc.start()
    try:
        good, bad = photos["chelsea"], photos["coffee"][:300]
        results = await asyncio.gather(
            enc.encode(good),
            enc.encode(bad),
            enc.encode(b"not an image"),
            enc.encode(good),
            return_exceptions=True,
        )
        assert isinstance(results[1], ImageError) and results[1].code == "invalid_image"
        assert isinstance(results[2], ImageError) and results[2].code == "invalid_image"
        assert isinstance(results[0], EncodedImage) and isinstance(results[3], EncodedImage)
        assert results[0].timings_ms["batch_size"] == 2 and enc.batches == 1
    finally:
        await enc.aclose()


async def test_max_batch_splits_bursts(tiny_clip_dir, photos):
    enc = LocalEncoder(_config(tiny_clip_dir, max_batch=2), hidden_size=48)
    await enc.start()
    try:
        results = await asyncio.gather(*(enc.encode(photos["rocket"]) for _ in range(5)))
        assert enc.batches == 3
        assert sorted(r.timings_ms["batch_size"] for r in results) == [1, 2, 2, 2, 2]
        # same bytes -> same tokens, whatever batch they were in
        assert len({r.payload.to_bytes() for r in results}) == 1
    finally:
        await enc.aclose()


async def test_on_a_cpu_images_are_encoded_one_at_a_time(tiny_clip_dir, photos):
    enc = LocalEncoder(_config(tiny_clip_dir, cpu_batch=1), hidden_size=48)
    await enc.start()
    try:
        assert enc.pipeline is not None and enc.pipeline.batch_limit == 1
        results = await asyncio.gather(*(enc.encode(d) for d in photos.values()))
        assert enc.batches == len(photos)
        assert {r.timings_ms["batch_size"] for r in results} == {1}
    finally:
        await enc.aclose()
    assert EncoderConfig().cpu_batch == 1


async def test_guards_and_lifecycle(tiny_clip_dir, photos):
    enc = LocalEncoder(_config(tiny_clip_dir, max_image_bytes=1000), hidden_size=48)
    with pytest.raises(RuntimeError):
        await enc.encode(photos["rocket"])
    await enc.start()
    with pytest.raises(ImageError) as info:
        await enc.encode(photos["rocket"])
    assert info.value.code == "image_too_large"
    await enc.aclose()
    with pytest.raises(RuntimeError):
        await enc.encode(b"x")


def test_fingerprint_tracks_what_shapes_the_tokens(tiny_clip_dir):
    base = EncoderConfig()
    fp = encoder_fingerprint(base, 576, None)
    assert fp == encoder_fingerprint(EncoderConfig(), 576, None)
    assert len(fp) == 64 and int(fp, 16) >= 0
    changed = [
        EncoderConfig(pruning="topk"),
        EncoderConfig(keep_ratio=0.3),
        EncoderConfig(max_keep_ratio=0.6),
        EncoderConfig(merge_tokens=4),
        EncoderConfig(int4_group_size=32),
        EncoderConfig(feature_layer=-1),
        EncoderConfig(seed=1),
        EncoderConfig(tower="vit-l14-336"),
        EncoderConfig(tower=tiny_clip_dir),
    ]
    fps = {encoder_fingerprint(c, 576, None) for c in changed}
    assert len(fps) == len(changed) and fp not in fps
    assert encoder_fingerprint(base, 960, None) != fp  # projector width
    assert encoder_fingerprint(base, 576, 0.02) != fp  # projector output scale
    same = [
        EncoderConfig(max_batch=2),
        EncoderConfig(cpu_batch=4),
        EncoderConfig(max_wait_ms=1.0),
        EncoderConfig(device="cpu"),
    ]
    assert {encoder_fingerprint(c, 576, None) for c in same} == {fp}


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"pruning": "half"}, "pruning"),
        ({"min_keep_ratio": 0.6, "max_keep_ratio": 0.5}, "min_keep_ratio"),
        ({"keep_ratio": 0.0}, "keep_ratio"),
        ({"int4_group_size": 48}, "int4_group_size"),
        ({"tower": "/nonexistent/dir"}, "tower"),
        ({"max_batch": 0}, "max_batch"),
        ({"cpu_batch": 0}, "cpu_batch"),
        ({"device": "tpu"}, "device"),
        ({"feature_layer": 0}, "feature_layer"),
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        EncoderConfig(**kw)


async def test_default_tower_end_to_end(photos):
    """The embedded default: synthetic ViT-B/16@224, dynamic pruning, INT4, LM-scale tokens."""
    enc = LocalEncoder(EncoderConfig(), hidden_size=576, target_rms=0.02)
    await enc.start()
    try:
        a, b = await asyncio.gather(enc.encode(photos["astronaut"]), enc.encode(photos["coffee"]))
        again = await enc.encode(photos["astronaut"])
    finally:
        await enc.aclose()
    for r in (a, b):
        assert r.tokens_total == 196
        assert 0.1 * 196 - 1 <= r.tokens_kept <= 0.5 * 196 + 1
        e = r.embeds()
        assert e.shape == (r.tokens_kept, 576)
        assert float(e.square().mean().sqrt()) == pytest.approx(0.02, rel=0.05)
        positions = r.payload.positions_list()
        assert positions == sorted(positions) and len(set(positions)) == len(positions)
    assert again.payload.to_bytes() == a.payload.to_bytes()
    assert torch.equal(again.embeds(), a.embeds())


async def test_each_batch_runs_inside_on_batch(tiny_clip_dir, photos):
    """The gateway's core share hears of every batch, and of nothing else."""
    running = 0
    seen: list[int] = []

    @contextlib.contextmanager
    def on_batch():
        nonlocal running
        running += 1
        seen.append(running)
        try:
            yield
        finally:
            running -= 1

    enc = LocalEncoder(_config(tiny_clip_dir, max_batch=2), hidden_size=48, on_batch=on_batch)
    await enc.start()
    try:
        await asyncio.gather(*(enc.encode(photos["rocket"]) for _ in range(3)))
        assert seen == [1, 1] and enc.batches == 2  # one context a batch, never two at once
        assert running == 0
    finally:
        await enc.aclose()
