"""The LLaVA family against transformers' own LlavaForConditionalGeneration and LlavaProcessor,
on a tiny random-weight checkpoint (tests/vlm_checkpoints/llava.py) and real photos."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest
import skimage.data
import torch
from PIL import Image

from encoder_worker.config import EncoderConfig, tower_family
from encoder_worker.decode import decode_image
from encoder_worker.families import UnsupportedCheckpoint, VisionFamily, load_family
from encoder_worker.payload import (
    FloatTokens,
    VisualTokens,
    float_tokens,
    payload_from_bytes,
    quantize_tokens,
    to_embeds,
)
from encoder_worker.pipeline import EncoderPipeline, encoder_fingerprint
from tests.encoder_worker.conftest import encode_image
from tests.vlm_checkpoints import llava

CPU = torch.device("cpu")
PHOTOS = ("astronaut", "coffee")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return llava.build(tmp_path_factory.mktemp("llava"), seed=0)


@pytest.fixture(scope="module")
def family(ckpt):
    return load_family(ckpt, CPU, torch.float32)


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(ckpt, local_files_only=True).eval()
    return model, AutoProcessor.from_pretrained(ckpt, local_files_only=True)


def hf_image_features(model, pixel_values: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.get_image_features(pixel_values=pixel_values)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    return (
        torch.cat(list(feats))
        if isinstance(feats, (list, tuple))
        else feats.reshape(-1, feats.shape[-1])
    )


@pytest.mark.parametrize("name", PHOTOS)
def test_embeds_equal_get_image_features(family, hf, name) -> None:
    model, processor = hf
    rgb = getattr(skimage.data, name)()
    pixels = processor(images=Image.fromarray(rgb), text="<image>", return_tensors="pt")[
        "pixel_values"
    ]
    assert torch.equal(family.pixel_values(rgb), pixels)  # the checkpoint's own preprocessing
    expected = hf_image_features(model, pixels)  # [N, lm_hidden]
    out = family.encode(rgb)
    assert out.embeds.shape == expected.shape == (64, 64)
    assert torch.allclose(out.embeds, expected, atol=1e-5, rtol=0), (
        (out.embeds - expected).abs().max()
    )
    assert out.runs == [64] and out.mrope is None
    assert out.saliency.shape == (64,) and torch.isfinite(out.saliency).all()
    # CLS attention over the patch rows: positive, at most one unit of mass per head
    assert (out.saliency > 0).all() and out.saliency.sum() < 4.0
    assert isinstance(family, VisionFamily)


def test_layout_is_the_processor_expansion(family, hf) -> None:
    model, processor = hf
    rgb = skimage.data.chelsea()
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt.count(family.placeholder) == 1
    ids = processor(images=Image.fromarray(rgb), text=prompt, return_tensors="pt")["input_ids"][0]
    n_image = int((ids == model.config.image_token_id).sum())
    out = family.encode(rgb)
    layout = family.layout([64], out)
    assert layout.placeholder == "<image>" == processor.image_token
    assert layout.pieces == (n_image,) and layout.rows == n_image == 64
    # the rows are contiguous where the processor put its image tokens
    where = (ids == model.config.image_token_id).nonzero().squeeze(1)
    assert int(where[-1] - where[0]) + 1 == n_image
    assert family.layout([10], out).pieces == (10,)
    with pytest.raises(ValueError):
        family.layout([65], out)
    with pytest.raises(ValueError):
        family.layout([3, 4], out)


def test_only_the_encoder_side_is_loaded(family, ckpt) -> None:
    # the default feature layer is -2 of 3: the last layer is never built, nor the LM
    assert len(family.tower.encoder.layers) == 2
    loaded = sum(p.numel() for m in (family.tower, family.projector) for p in m.parameters())
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    vision = sum(
        int(np.prod(s))
        for k, s in sizes.items()
        if k.startswith(("vision_tower.", "multi_modal_projector.")) and "layers.2." not in k
    )
    assert loaded == vision
    assert family.lm_hidden_size == 64 and family.describe()["feature_layer"] == -2


@pytest.mark.parametrize("layout", ["model", "vision_model"])
def test_key_layouts_load_the_same_weights(family, tmp_path, layout) -> None:
    other = load_family(
        llava.build(tmp_path / layout, seed=0, key_layout=layout), CPU, torch.float32
    )
    rgb = skimage.data.coffee()
    assert torch.equal(other.encode(rgb).embeds, family.encode(rgb).embeds)


def test_feature_layer_list_and_full_strategy(hf, tmp_path) -> None:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = llava.build(tmp_path / "multi", seed=3, feature_layer=[-3, -1], select_strategy="full")
    fam = load_family(path, CPU, torch.float32)
    model = LlavaForConditionalGeneration.from_pretrained(path, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    rgb = skimage.data.rocket()
    pixels = processor(images=Image.fromarray(rgb), text="<image>", return_tensors="pt")[
        "pixel_values"
    ]
    expected = hf_image_features(model, pixels)
    out = fam.encode(rgb)
    assert out.embeds.shape == expected.shape == (65, 64)  # CLS kept under "full"
    assert torch.allclose(out.embeds, expected, atol=1e-5, rtol=0)
    assert len(fam.tower.encoder.layers) == 3
    assert (
        processor(images=Image.fromarray(rgb), text="<image>")["input_ids"][0].count(
            model.config.image_token_id
        )
        == fam.layout([65], out).rows
    )


def test_fingerprint_follows_the_checkpoint(ckpt, tmp_path) -> None:
    base = EncoderConfig(tower=str(ckpt), device="cpu")
    fp = encoder_fingerprint(base, 64, None)
    # the projector is the checkpoint's: the synthetic handshake values do not enter
    assert encoder_fingerprint(base, 576, 0.1355) == fp
    # a copy elsewhere is the same checkpoint (workers may mount it at another path)
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    assert encoder_fingerprint(msgspec.structs.replace(base, tower=str(copy)), 64, None) == fp
    # another seed: other weights
    other = llava.build(tmp_path / "seed1", seed=1)
    assert encoder_fingerprint(msgspec.structs.replace(base, tower=str(other)), 64, None) != fp
    # same shapes, one vision weight nudged (a fine-tune): the content hash sees it
    from safetensors.torch import load_file, save_file

    tuned = tmp_path / "tuned"
    shutil.copytree(ckpt, tuned)
    tensors = load_file(tuned / "model.safetensors")
    tensors["vision_tower.encoder.layers.0.mlp.fc1.bias"] += 1e-3
    save_file(tensors, tuned / "model.safetensors", metadata={"format": "pt"})
    assert encoder_fingerprint(msgspec.structs.replace(base, tower=str(tuned)), 64, None) != fp
    # and so do the things that shape the stored tokens
    for change in ({"pruning": "none"}, {"visual_tokens": "bf16"}, {"keep_ratio": 0.5}):
        assert encoder_fingerprint(msgspec.structs.replace(base, **change), 64, None) != fp


@pytest.mark.parametrize("form", ["fp32", "bf16", "int4"])
def test_payload_round_trips(family, form) -> None:
    rows = family.encode(skimage.data.astronaut()).embeds  # [64, 64]
    positions = torch.arange(0, 64, 2)
    kept = rows[positions]
    if form == "int4":
        payload = quantize_tokens(kept, positions, 64, 32)
    else:
        payload = float_tokens(kept, positions, 64, form)
    data = payload.to_bytes()
    back = payload_from_bytes(data)
    assert type(back) is type(payload) and back == payload and back.to_bytes() == data
    assert back.positions_list() == positions.tolist()
    got = to_embeds(data)
    assert got.dtype == torch.float32 and got.shape == kept.shape
    if form == "fp32":
        assert torch.equal(got, kept)
    elif form == "bf16":
        assert torch.equal(got, kept.to(torch.bfloat16).float())
    else:
        assert (got - kept).abs().max() < 0.15 * kept.abs().max()
    # malformed bytes are refused, never half-read
    cls = FloatTokens if form != "int4" else VisualTokens
    for bad in (data[:-1], data + b"\0", b"XXXX" + data[4:], data[:6], b""):
        with pytest.raises(ValueError):
            cls.from_bytes(bad)
        with pytest.raises(ValueError):
            payload_from_bytes(bad)


def test_float_header_checks() -> None:
    from encoder_worker.payload import FloatHeader

    good = float_tokens(torch.ones(2, 8), torch.arange(2), 4, "fp32")
    for header in (
        FloatHeader(1, 2, 8, "fp16", 4),
        FloatHeader(2, 2, 8, "fp32", 4),
        FloatHeader(1, 2, 0, "fp32", 4),
        FloatHeader(1, 2, 8, "fp32", 4, 3),
    ):
        forged = FloatTokens(header, good.values, good.positions).to_bytes()
        with pytest.raises(ValueError):
            FloatTokens.from_bytes(forged)
    with pytest.raises(ValueError):
        float_tokens(torch.ones(2, 8), torch.arange(2), 4, "fp16")


@pytest.mark.parametrize("mode", ["topk", "dynamic", "random"])
def test_pruning_keeps_a_subset_in_order(ckpt, family, mode) -> None:
    pipe = EncoderPipeline(
        EncoderConfig(
            tower=str(ckpt), device="cpu", pruning=mode, visual_tokens="fp32", keep_ratio=0.25
        ),
        64,
    )
    data = encode_image(skimage.data.chelsea(), "PNG")
    try:
        (image,) = pipe.encode_batch([data])
        # outside exact mode a big image may be decoded reduced (to no less than twice the
        # processor's size) before the processor resizes it: compare on the same pixels
        assert pipe._min_side == 64
        rgb = decode_image(data, 1 << 30, 1 << 30, min_side=pipe._min_side)
    finally:
        pipe.close()
    full = family.encode(rgb).embeds
    positions = image.payload.positions_list()
    assert positions == sorted(set(positions)) and 0 < len(positions) < 64
    assert image.tokens_kept == len(positions) == image.layout.rows
    assert image.layout.pieces == (len(positions),) and image.tokens_total == 64
    if mode in ("topk", "random"):
        assert len(positions) == 16
    assert torch.equal(image.embeds(), full[positions])


def test_dynamic_merge_acts_as_dynamic_for_checkpoints(ckpt) -> None:
    data = encode_image(skimage.data.coffee(), "PNG")
    got = {}
    for mode in ("dynamic", "dynamic+merge"):
        pipe = EncoderPipeline(
            EncoderConfig(tower=str(ckpt), device="cpu", pruning=mode, visual_tokens="fp32"), 64
        )
        try:
            (got[mode],) = pipe.encode_batch([data])
        finally:
            pipe.close()
    assert got["dynamic"].payload == got["dynamic+merge"].payload
    assert got["dynamic"].layout == got["dynamic+merge"].layout


def test_unsupported_vlm_names_the_supported_families(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llava_next", "vision_config": {}, "text_config": {}})
    )
    with pytest.raises(UnsupportedCheckpoint, match="llava.*qwen2_5_vl"):
        tower_family(str(tmp_path))
    with pytest.raises(UnsupportedCheckpoint, match="supported: "):
        load_family(tmp_path, CPU, torch.float32)
    with pytest.raises(ValueError, match="supported"):
        EncoderPipeline(EncoderConfig(tower=str(tmp_path), device="cpu"), 64)


def test_width_mismatch_is_refused(ckpt) -> None:
    with pytest.raises(ValueError, match="64 wide"):
        EncoderPipeline(EncoderConfig(tower=str(ckpt), device="cpu"), 576)


# -- checkpoints built otherwise, through the project's whole path ------------------------------
#
# Each variant reads the tower at another depth and keeps other rows: the last layer with the
# CLS row kept ("full"), two layers concatenated, the first layer alone; the photos differ in
# size and aspect ratio (the processor's shortest-edge resize and center crop see a portrait
# crop, a 5:1 strip, a small image it scales up, a grayscale photo). Rows and greedy answers
# must be transformers' own.
# The seeds are ones whose greedy steps all win by a logit margin over 0.01, a hundred times
# the 1e-4 the engine's logits are held to against the full model's (reordered float sums:
# the engine packs and chunks what generate computes in one pass).

MAX_NEW = 8
VARIANTS = {
    "last-full": (
        {"seed": 2, "feature_layer": -1, "select_strategy": "full"},
        ("tall", "strip"),
    ),
    "two-layers": ({"seed": 3, "feature_layer": [-3, -2]}, ("small", "camera")),
    "first-layer": ({"seed": 2, "feature_layer": -3}, ("chelsea", "coffee")),
}


@functools.cache
def _variant(key: str, root: Path) -> tuple[list, list]:
    from tests.vlm_checkpoints import exactness

    options, names = VARIANTS[key]
    path = llava.build(root / key, **options)
    photos = [exactness.shaped(n) for n in names]
    refs = exactness.reference("llava", path, photos, MAX_NEW)
    return refs, exactness.project_answers(path, photos, MAX_NEW)


@pytest.fixture(scope="module")
def variant_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("llava-variants")


@pytest.mark.parametrize("key", VARIANTS)
def test_variant_rows_and_answers_equal_transformers(key, variant_root) -> None:
    from tests.vlm_checkpoints.exactness import assert_same_answer

    refs, ours = _variant(key, variant_root)
    rows = 65 if VARIANTS[key][0].get("select_strategy") == "full" else 64
    for ref, got in zip(refs, ours, strict=True):
        assert got.rows.shape == ref.features.shape == (rows, 64)
        torch.testing.assert_close(got.rows, ref.features, rtol=0, atol=1e-5)
        assert got.tokens_kept == got.tokens_total == rows  # exact mode drops nothing
        assert got.mrope is None
        assert_same_answer(got, ref, MAX_NEW)
    assert refs[0].tokens != refs[1].tokens  # the photo moves the answer
