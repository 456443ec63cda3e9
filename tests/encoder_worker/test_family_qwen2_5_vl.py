"""The Qwen2.5-VL family against transformers' own model and processor on a tiny checkpoint.

Rows must equal `get_image_features`, the M-RoPE offsets must reproduce `get_rope_index`, and
the layout must expand to the processor's own input_ids, on real photos of different shapes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from encoder_worker.checkpoint import checkpoint_id
from encoder_worker.families import UnsupportedCheckpoint, VisionFamily, detect_family, load_family
from encoder_worker.families.qwen2_5_vl import PLACEHOLDER, describe_checkpoint, smart_resize
from encoder_worker.types import ImageError, ImageLayout
from gateway.testing.images import photo_array as photo
from tests.vlm_checkpoints import qwen2_5_vl as builder

CPU = torch.device("cpu")
PHOTOS = ("astronaut", "rocket")  # 512 x 512 and 427 x 640: square and landscape grids


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return builder.build(tmp_path_factory.mktemp("qwen2_5_vl"), seed=0)


@pytest.fixture(scope="module")
def model(checkpoint):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="module")
def processor(checkpoint):
    return builder.load_processor(checkpoint)


@pytest.fixture(scope="module")
def family(checkpoint):
    return load_family(checkpoint, CPU, torch.float32)


def messages(n_images: int) -> list[dict]:
    content: list[dict] = [{"type": "text", "text": "Look at this:"}]
    for i in range(n_images):
        content.append({"type": "image"})
        content.append({"type": "text", "text": f" and that was picture {i}. "})
    content.append({"type": "text", "text": "What do you see?"})
    return [{"role": "user", "content": content}]


def reference_inputs(processor, names: tuple[str, ...]) -> dict:
    text = processor.apply_chat_template(
        messages(len(names)), add_generation_prompt=True, tokenize=False
    )
    images = [Image.fromarray(photo(n)) for n in names]
    return processor(images=images, text=[text], return_tensors="pt")


def test_detected_and_shaped_like_the_contract(checkpoint, family) -> None:
    assert detect_family(checkpoint) == "qwen2_5_vl"
    assert isinstance(family, VisionFamily)
    assert family.lm_hidden_size == 64
    assert family.placeholder == PLACEHOLDER == "<|image_pad|>"
    assert family.weights_id == checkpoint_id(checkpoint)
    described = family.describe()
    assert described == describe_checkpoint(checkpoint)  # from the files alone
    assert described["image_processor"]["max_pixels"] == builder.MAX_PIXELS
    assert described["fullatt_block_indexes"] == [1, 3]


@pytest.mark.parametrize("name", PHOTOS)
def test_rows_equal_get_image_features(name, family, model, processor) -> None:
    rgb = photo(name)
    ref = processor.image_processor(images=[Image.fromarray(rgb)], return_tensors="pt")
    rows, grid = family.preprocess(rgb)
    assert list(grid) == ref["image_grid_thw"][0].tolist()
    assert np.array_equal(rows, ref["pixel_values"].numpy())  # preprocessing to the bit

    out = family.encode(rgb)
    with torch.no_grad():
        expected = model.get_image_features(ref["pixel_values"], ref["image_grid_thw"])
    expected = expected.pooler_output[0]  # [N, 64]
    _, gh, gw = grid
    n = (gh // 2) * (gw // 2)
    assert out.embeds.shape == expected.shape == (n, 64)
    assert out.embeds.dtype == torch.float32
    torch.testing.assert_close(out.embeds, expected, rtol=0, atol=1e-5)
    assert out.runs == [n]
    torch.testing.assert_close(out.saliency, out.embeds.norm(dim=-1))
    assert out.mrope.shape == (3, n) and out.mrope.dtype == torch.int64
    assert out.mrope_advance == max(gh, gw) // 2


def test_photos_of_different_shape_get_different_grids(family) -> None:
    square, wide = (family.preprocess(photo(n))[1] for n in PHOTOS)
    assert square[1] == square[2] and wide[2] > wide[1]


def test_batch_equals_single_encodes(family) -> None:
    batch = family.encode_batch([photo(n) for n in PHOTOS])
    for name, out in zip(PHOTOS, batch, strict=True):
        single = family.encode(photo(name))
        torch.testing.assert_close(out.embeds, single.embeds, rtol=0, atol=1e-5)
        assert torch.equal(out.mrope, single.mrope)


def positions_from_layouts(
    input_ids: torch.Tensor, image_token_id: int, layouts: list[ImageLayout]
) -> torch.Tensor:
    """[3, L] M-RoPE positions the way the engine places them: text advances by one, an image
    sits at the running position plus its rows' offsets, then the text resumes past it."""
    cols: list[torch.Tensor] = []
    pos, i, ids = 0, 0, input_ids.tolist()
    pending = iter(layouts)
    while i < len(ids):
        if ids[i] != image_token_id:
            cols.append(torch.full((3, 1), pos, dtype=torch.int64))
            pos, i = pos + 1, i + 1
            continue
        layout = next(pending)
        offsets = torch.tensor(layout.mrope, dtype=torch.int64).view(-1, 3).t()  # [3, N]
        cols.append(offsets + pos)
        pos, i = pos + layout.mrope_advance, i + layout.rows
    return torch.cat(cols, dim=1)


def test_mrope_reproduces_get_rope_index(family, model, processor) -> None:
    ref = reference_inputs(processor, PHOTOS)
    ids = ref["input_ids"][0]
    image_token_id = model.config.image_token_id
    expected, delta = model.model.get_rope_index(
        ref["input_ids"], ref["mm_token_type_ids"], image_grid_thw=ref["image_grid_thw"]
    )
    expected = expected[:, 0]  # [3, L]

    outs = [family.encode(photo(n)) for n in PHOTOS]
    # each image's block: the columns of its tokens minus the image's start offset
    is_image = (ids == image_token_id).nonzero().flatten().tolist()
    start = 0
    for out in outs:
        n = out.embeds.shape[0]
        block = is_image[start : start + n]
        assert block == list(range(block[0], block[0] + n))  # contiguous
        first = block[0]
        offset = int(expected[0, first - 1]) + 1  # the text position the image starts at
        assert torch.equal(expected[:, first : first + n] - offset, out.mrope)
        after = first + n  # the text right after the image resumes at offset + advance
        assert expected[:, after].tolist() == [offset + out.mrope_advance] * 3
        start += n
    assert start == len(is_image)

    layouts = [family.layout(out.runs, out) for out in outs]
    got = positions_from_layouts(ids, image_token_id, layouts)
    assert torch.equal(got, expected)
    assert int(got.max()) + 1 - ids.shape[0] == int(delta)


def expand(text: str, layouts: list[ImageLayout]) -> str:
    """Replace each placeholder, in order, by its layout's pieces (rows -> placeholder copies)."""
    chunks = text.split(PLACEHOLDER)
    assert len(chunks) == len(layouts) + 1
    out = [chunks[0]]
    for layout, chunk in zip(layouts, chunks[1:], strict=True):
        for piece in layout.pieces:
            out.append(piece if isinstance(piece, str) else PLACEHOLDER * piece)
        out.append(chunk)
    return "".join(out)


def test_layout_expansion_tokenizes_to_processor_ids(family, processor) -> None:
    text = processor.apply_chat_template(messages(2), add_generation_prompt=True, tokenize=False)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    layouts = [family.layout(o.runs, o) for o in (family.encode(photo(n)) for n in PHOTOS)]
    ids = processor.tokenizer(expand(text, layouts), add_special_tokens=False)["input_ids"]
    assert ids == reference_inputs(processor, PHOTOS)["input_ids"][0].tolist()


def test_pruned_layout_keeps_original_positions(family) -> None:
    out = family.encode(photo("rocket"))
    n = out.embeds.shape[0]
    keep = torch.arange(0, n, 3)  # drop two rows in three
    pruned = type(out)(
        embeds=out.embeds[keep],
        saliency=out.saliency[keep],
        runs=[len(keep)],
        mrope=out.mrope[:, keep],
        mrope_advance=out.mrope_advance,
    )
    layout = family.layout(pruned.runs, pruned)
    assert layout.pieces == (len(keep),) and layout.rows == len(keep)
    cols = torch.tensor(layout.mrope).view(-1, 3).t()
    assert torch.equal(cols, out.mrope[:, keep])
    assert cols[:, -1].tolist() == [0, int(keep[-1]) // 7, int(keep[-1]) % 7]  # 5 x 7 grid
    assert layout.mrope_advance == 7  # the unpruned grid's extent, not the kept rows'
    # from the unpruned output: the count and the advance; the caller adds the kept columns
    partial = family.layout([len(keep)], out)
    assert partial.pieces == (len(keep),) and partial.mrope == () and partial.mrope_advance == 7
    with pytest.raises(ValueError, match="one run"):
        family.layout([len(keep), 0], pruned)
    with pytest.raises(ValueError, match="kept rows"):
        family.layout([n + 1], out)


def test_smart_resize_matches_the_processor() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        smart_resize as reference,
    )

    for h in (10, 27, 56, 300, 427, 512, 1080, 4000):
        for w in (14, 33, 451, 640, 1920, 3000):
            if max(h, w) / min(h, w) > 200:
                continue
            args = (28, builder.MIN_PIXELS, builder.MAX_PIXELS)
            assert smart_resize(h, w, *args) == reference(h, w, *args), (h, w)


def test_too_elongated_image_is_refused(family) -> None:
    with pytest.raises(ImageError) as info:
        family.encode(np.zeros((2, 500, 3), dtype=np.uint8))
    assert info.value.code == "invalid_image"


def test_loads_without_language_model_weights(tmp_path, checkpoint, family) -> None:
    """Module-path keys (model.visual.*) and a file with nothing but the vision tower."""
    ck = builder.build(tmp_path / "ck", seed=0, module_keys=True)
    tensors = load_file(ck / "model.safetensors")
    assert any(k.startswith("model.language_model.") for k in tensors)
    vision_only = {k: v for k, v in tensors.items() if k.startswith("model.visual.")}
    save_file(vision_only, ck / "model.safetensors", metadata={"format": "pt"})
    other = load_family(ck, CPU, torch.float32)
    rgb = photo("astronaut")
    assert torch.equal(other.encode(rgb).embeds, family.encode(rgb).embeds)


def test_refuses_checkpoints_without_safetensors_vision_weights(tmp_path, checkpoint) -> None:
    ck = builder.build(tmp_path / "ck", seed=0)
    tensors = load_file(ck / "model.safetensors")
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith("visual.")},
        ck / "model.safetensors",
        metadata={"format": "pt"},
    )
    with pytest.raises(UnsupportedCheckpoint, match="no vision tower weights"):
        load_family(ck, CPU, torch.float32)
    (ck / "model.safetensors").unlink()
    with pytest.raises(UnsupportedCheckpoint, match="safetensors"):
        load_family(ck, CPU, torch.float32)


def test_bfloat16_tower_stays_close(checkpoint, family) -> None:
    half = load_family(checkpoint, CPU, torch.bfloat16)
    rgb = photo("rocket")
    torch.testing.assert_close(
        half.encode(rgb).embeds, family.encode(rgb).embeds, rtol=0.05, atol=0.05
    )


# -- checkpoints built otherwise, through the project's whole path ------------------------------
#
# Each variant changes what shapes the visual tokens and their positions: the tower's window
# (in merged tokens: 4, 3 which leaves partial windows at every edge, 4 with no merge), which
# blocks attend over the whole image (one, none, two), the text model's M-RoPE sections (and
# head width), a sliding-window text layer, the processor's pixel bounds; and the photos differ
# in size and aspect ratio (landscape, portrait crop, a 5:1 strip, a small image the processor
# scales up, a grayscale photo). Rows, positions and greedy answers must be transformers' own.
# The seeds are ones whose greedy steps all win by a logit margin over 0.01, a hundred times
# the 1e-4 the engine's logits are held to against the full model's (reordered float sums:
# the engine packs and chunks what generate computes in one pass).

MAX_NEW = 8
_T = 28 * 28  # pixels per merged token at merge 2


def _mrope(section: list[int]) -> dict:
    return {"rope_type": "default", "rope_theta": 1e6, "mrope_section": section}


VARIANTS = {
    "win4-full0-mrope422": (
        {
            "seed": 4,
            "vision": {"window_size": 112, "fullatt_block_indexes": [0], "depth": 3},
            "text": {"rope_parameters": _mrope([4, 2, 2])},
            "min_pixels": _T * 8,
            "max_pixels": _T * 80,
        },
        ("coffee", "tall"),
    ),
    "win3-nofull-heads2-mrope844": (
        {
            "seed": 5,
            "vision": {"window_size": 84, "fullatt_block_indexes": [], "depth": 2},
            "text": {"num_attention_heads": 2, "rope_parameters": _mrope([8, 4, 4])},
            "min_pixels": _T * 6,
            "max_pixels": _T * 24,
        },
        ("strip", "small"),
    ),
    "merge1-full12-mrope224-sliding": (
        {
            "seed": 5,
            "vision": {
                "window_size": 56,
                "spatial_merge_size": 1,
                "fullatt_block_indexes": [1, 2],
                "depth": 3,
            },
            "text": {
                "rope_parameters": _mrope([2, 2, 4]),
                "use_sliding_window": True,
                "sliding_window": 24,
                "max_window_layers": 1,
            },
            "min_pixels": 14 * 14 * 8,
            "max_pixels": 14 * 14 * 60,
        },
        ("chelsea", "camera"),
    ),
}


@functools.cache
def _variant(key: str, root: Path) -> tuple[Path, list, list]:
    from tests.vlm_checkpoints import exactness

    options, names = VARIANTS[key]
    path = builder.build(root / key, **options)
    photos = [exactness.shaped(n) for n in names]
    refs = exactness.reference("qwen2_5_vl", path, photos, MAX_NEW)
    ours = exactness.project_answers(path, photos, MAX_NEW)
    return path, refs, ours


@pytest.fixture(scope="module")
def variant_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qwen2_5_vl-variants")


@pytest.mark.parametrize("key", VARIANTS)
def test_variant_rows_equal_get_image_features(key, variant_root) -> None:
    path, refs, ours = _variant(key, variant_root)
    merge = VARIANTS[key][0]["vision"].get("spatial_merge_size", 2)
    grids = set()
    for ref, got in zip(refs, ours, strict=True):
        _, gh, gw = ref.grid_thw
        grids.add((gh, gw))
        assert got.rows.shape == ref.features.shape == ((gh // merge) * (gw // merge), 64)
        torch.testing.assert_close(got.rows, ref.features, rtol=0, atol=1e-5)
        # exact mode drops nothing
        assert got.tokens_kept == got.tokens_total == got.rows.shape[0]
    assert len(grids) == len(refs)  # the photos' aspect ratios give different grids


@pytest.mark.parametrize("key", VARIANTS)
def test_variant_positions_equal_get_rope_index(key, variant_root) -> None:
    _, refs, ours = _variant(key, variant_root)
    for ref, got in zip(refs, ours, strict=True):
        assert got.input_ids == ref.input_ids
        assert got.mrope is not None and torch.equal(got.mrope, ref.mrope)
        assert got.rope_delta == ref.rope_delta != 0


@pytest.mark.parametrize("key", VARIANTS)
def test_variant_answers_equal_generate(key, variant_root) -> None:
    from tests.vlm_checkpoints.exactness import assert_same_answer

    _, refs, ours = _variant(key, variant_root)
    for ref, got in zip(refs, ours, strict=True):
        assert_same_answer(got, ref, MAX_NEW)
        # the comparison sees positions: with 1-D positions transformers answers otherwise
        assert ref.tokens_1d != ref.tokens
