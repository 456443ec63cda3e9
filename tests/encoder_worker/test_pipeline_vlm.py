"""EncoderPipeline and its carriers over a real (tiny) LLaVA checkpoint: exact mode against
transformers, the layout through the vision cache (memory and a real redis-server), the
remote worker path, and the gateway wiring (settings, worker flags, model label, messages)."""

from __future__ import annotations

import argparse
import io
import types
from pathlib import Path

import msgspec
import pytest
import torch
from PIL import Image

from encoder_worker import EncodedImage, EncoderConfig, EncoderPipeline, ImageError, LocalEncoder
from encoder_worker.payload import FloatTokens
from encoder_worker.storage import pack_encoded, unpack_encoded
from encoder_worker.types import ImageLayout
from encoder_worker.worker import EncoderWorker
from gateway.encoders.redis_encoder import RedisEncoder
from tests.encoder_worker.test_family_llava import hf_image_features
from tests.encoder_worker.test_worker import serving
from tests.vlm_checkpoints import llava

EXACT = {"pruning": "none", "visual_tokens": "fp32", "device": "cpu"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return llava.build(tmp_path_factory.mktemp("llava-pipe"), seed=5)


@pytest.fixture(scope="module")
def exact(ckpt):
    pipe = EncoderPipeline(EncoderConfig(tower=str(ckpt), **EXACT), 64)
    yield pipe
    pipe.close()


def test_exact_mode_rows_are_get_image_features(ckpt, exact, photos) -> None:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(ckpt, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(ckpt, local_files_only=True)
    names = ("astronaut", "rocket")
    results = exact.encode_batch([photos[n] for n in names] + [b"not an image"])
    assert isinstance(results[2], ImageError) and results[2].code == "invalid_image"
    for name, image in zip(names, results[:2], strict=True):
        # transformers' own path: PIL opens the same bytes, the checkpoint's processor prepares them
        pil = Image.open(io.BytesIO(photos[name])).convert("RGB")
        pixels = processor(images=pil, text="<image>", return_tensors="pt")["pixel_values"]
        expected = hf_image_features(model, pixels)
        got = image.embeds()
        assert isinstance(image, EncodedImage) and isinstance(image.payload, FloatTokens)
        assert got.shape == expected.shape == (64, 64)
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
        assert image.tokens_kept == image.tokens_total == 64 and image.hidden_size == 64
        assert image.layout == ImageLayout("<image>", (64,))
        assert image.fingerprint == exact.fingerprint
    # same bytes, same rows, whatever the batch
    (again,) = exact.encode_batch([photos["rocket"]])
    assert again.payload == results[1].payload


def test_pack_unpack_keeps_the_layout(exact, photos) -> None:
    (image,) = exact.encode_batch([photos["coffee"]])
    back = unpack_encoded(pack_encoded(image))
    assert back.layout == image.layout and back.payload == image.payload
    assert torch.equal(back.embeds(), image.embeds())
    assert (back.digest, back.fingerprint, back.tokens_kept, back.tokens_total) == (
        image.digest,
        image.fingerprint,
        image.tokens_kept,
        image.tokens_total,
    )


def test_entries_without_a_layout_still_decode_and_bad_ones_are_refused(exact, photos) -> None:
    import struct

    (image,) = exact.encode_batch([photos["chelsea"]])

    class OldHeader(msgspec.Struct, array_like=True):  # the entry format before layouts
        digest: str
        fingerprint: str
        tokens_kept: int
        tokens_total: int
        hidden_size: int
        timings_ms: dict[str, float]

    head = msgspec.msgpack.encode(
        OldHeader(
            image.digest,
            image.fingerprint,
            image.tokens_kept,
            image.tokens_total,
            image.hidden_size,
            {"vision": 1.0},
        )
    )
    old = b"VGV1" + struct.pack("<I", len(head)) + head + image.payload.to_bytes()
    back = unpack_encoded(old)
    assert back.layout is None and back.payload == image.payload
    # a layout that places other than the stored rows is corrupt, not silently used
    wrong = msgspec.structs.replace(image.layout, pieces=(63,))
    broken = EncodedImage(
        **{
            **{
                f: getattr(image, f)
                for f in (
                    "digest",
                    "fingerprint",
                    "tokens_kept",
                    "tokens_total",
                    "hidden_size",
                    "payload",
                    "timings_ms",
                )
            },
            "layout": wrong,
        }
    )
    with pytest.raises(ValueError, match="layout"):
        unpack_encoded(pack_encoded(broken))
    data = pack_encoded(image)
    with pytest.raises(ValueError):
        unpack_encoded(data[:-3])


async def test_local_encoder_and_redis_cache_carry_the_layout(ckpt, photos, redis_url) -> None:
    from gateway.caching import MemoryVisionCache, TieredVisionCache

    config = EncoderConfig(
        tower=str(ckpt), device="cpu", pruning="topk", keep_ratio=0.5, visual_tokens="bf16"
    )
    local = LocalEncoder(config, 64, target_rms=None)
    await local.start()
    try:
        image = await local.encode(photos["astronaut"])
    finally:
        await local.aclose()
    assert image.layout == ImageLayout("<image>", (32,)) and image.tokens_kept == 32
    cache = TieredVisionCache(MemoryVisionCache(0), redis_url, ttl_s=60)
    try:
        await cache.put(image.fingerprint, image.digest, pack_encoded(image))
        hit = await cache.get(image.fingerprint, image.digest)
    finally:
        await cache.aclose()
    assert hit is not None and hit.tier == "redis"
    back = unpack_encoded(hit.payload)
    assert back.layout == image.layout and torch.equal(back.embeds(), image.embeds())


async def test_remote_worker_round_trip_keeps_the_layout(ckpt, photos, redis_url) -> None:
    from encoder_worker.process import DEFAULT_HIDDEN_SIZE, DEFAULT_TARGET_RMS

    config = EncoderConfig(tower=str(ckpt), device="cpu", pruning="dynamic", visual_tokens="int4")
    # the worker is built as `visiongate worker --model-path` builds it: no width, no RMS
    pipeline = EncoderPipeline(config, None, None)
    expected = pipeline.encode_batch([photos["rocket"]])[0]
    # the gateway passes its engine's width; the fingerprints agree from the checkpoint alone
    enc = RedisEncoder(redis_url, config, 64, None, timeout_s=60)
    assert enc.fingerprint == pipeline.fingerprint
    other = RedisEncoder(redis_url, config, DEFAULT_HIDDEN_SIZE, DEFAULT_TARGET_RMS)
    assert other.fingerprint == enc.fingerprint
    await enc.start()
    try:
        async with serving(EncoderWorker(redis_url, pipeline, block_ms=100)) as worker:
            got = await enc.encode(photos["rocket"])
    finally:
        await enc.aclose()
        pipeline.close()
    assert worker.encoded == 1
    assert got.layout == expected.layout and got.layout.rows == got.tokens_kept
    assert got.payload.to_bytes() == expected.payload.to_bytes()


def test_settings_cli_and_app_wiring(ckpt, tmp_path) -> None:
    from encoder_worker.process import worker_config
    from gateway.cli.main import build_parser
    from gateway.server.app import encoder_config
    from gateway.settings import Settings, SettingsError

    s = Settings.load(
        {"model_path": str(ckpt), "vision_tower": "vit-l14-336"},
        environ={"VISIONGATE_VISUAL_TOKENS": "fp32", "VISIONGATE_PRUNING": "none"},
    )
    config = encoder_config(s)
    assert config.tower == str(ckpt) and config.family == "llava" and config.exact
    with pytest.raises(SettingsError, match="VISIONGATE_VISUAL_TOKENS"):
        Settings.load(environ={"VISIONGATE_VISUAL_TOKENS": "int8"})
    assert encoder_config(Settings.load(environ={})).family is None  # the synthetic default

    args = build_parser().parse_args(
        ["serve", "--model-path", str(ckpt), "--visual-tokens", "bf16"]
    )
    assert (args.model_path, args.visual_tokens) == (str(ckpt), "bf16")
    args = build_parser().parse_args(
        [
            "worker",
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "--model-path",
            str(ckpt),
            "--visual-tokens",
            "fp32",
            "--pruning",
            "none",
        ]
    )
    wc = worker_config(args)
    assert wc.tower == str(ckpt) and wc.visual_tokens == "fp32"
    assert (args.hidden_size, args.target_rms) == (None, None)
    # the worker and the gateway with the same settings make the same fingerprint
    from encoder_worker.pipeline import encoder_fingerprint

    assert encoder_fingerprint(wc, None, None) == encoder_fingerprint(config, 64, None)
    # a text-only model path keeps the synthetic tower
    text_only = tmp_path / "text"
    text_only.mkdir()
    (text_only / "config.json").write_text('{"model_type": "llama"}')
    args = build_parser().parse_args(["worker", "--model-path", str(text_only)])
    assert worker_config(args).tower == "vit-b16-224"
    args = argparse.Namespace(**{**vars(args), "model_path": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="not a directory"):
        worker_config(args)


def test_model_card_labels_the_vision_encoder(ckpt) -> None:
    from gateway.api.openai.resources import SYNTHETIC_VISION_LABEL, vision_label
    from gateway.settings import Settings

    state = types.SimpleNamespace(settings=Settings.load(environ={}), serving=None)
    assert (
        vision_label(state)
        == SYNTHETIC_VISION_LABEL
        == "synthetic seeded tower, answers not grounded"
    )
    state = types.SimpleNamespace(
        settings=Settings.load({"model_path": str(ckpt)}, environ={}), serving=None
    )
    assert vision_label(state).startswith(f"llava checkpoint {ckpt.name}")
    encoder = types.SimpleNamespace(config=EncoderConfig(tower=str(ckpt), device="cpu"))
    serving = types.SimpleNamespace(encoder=encoder)
    state = types.SimpleNamespace(settings=state.settings, serving=serving)
    assert "own vision tower and projector" in vision_label(state)


def test_turn_messages_hand_the_layout_to_the_engine(exact, photos) -> None:
    from gateway.chat.turn_prompt import turn_messages
    from gateway.chat.vision_resolver import Resolved
    from gateway.sessions.session import Session, StoredItem, StoredPart

    (image,) = exact.encode_batch([photos["coffee"]])
    vision = types.SimpleNamespace(fingerprint=exact.fingerprint)
    session = Session(
        id="s",
        owner="o",
        created_at=0.0,
        updated_at=0.0,
        instructions="",
        max_output_tokens=8,
        items=[
            StoredItem(
                "i1",
                "user",
                [StoredPart("image", digest=image.digest), StoredPart("text", "what?")],
            )
        ],
    )
    messages = turn_messages(
        vision,
        session,
        types.SimpleNamespace(instructions=None, tools_prompt=None),
        {image.digest: Resolved(image, "encoded", 0.0)},
    )
    (part, text) = messages[0].content
    assert text == "what?" and part.layout == image.layout
    assert torch.equal(part.embeds, image.embeds())
