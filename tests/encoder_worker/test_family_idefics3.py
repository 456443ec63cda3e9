"""The Idefics3 / SmolVLM family against transformers itself, on a tiny random checkpoint.

Rows: `Family.encode` == the model's own `get_image_features` after its own image processor.
Pixels: our tiling + lookup-table normalization == the slow image processor, bit for bit.
Layout: the placeholder expanded by `Family.layout` tokenizes to exactly the processor's ids.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from encoder_worker.checkpoint import checkpoint_id
from encoder_worker.families import FAMILIES, UnsupportedCheckpoint, load_family
from encoder_worker.families.idefics3 import (
    Idefics3Output,
    TileSpec,
    describe_checkpoint,
    preprocess,
)
from encoder_worker.types import ImageError
from gateway.testing.images import photo_array as _photo
from tests.vlm_checkpoints import idefics3 as checkpoint

CPU = torch.device("cpu")
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return checkpoint.build(tmp_path_factory.mktemp("idefics3"), seed=0)


@pytest.fixture(scope="module")
def family(ckpt):
    return load_family(ckpt, CPU, torch.float32)


@pytest.fixture(scope="module")
def reference(ckpt):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(ckpt).eval()
    return model, AutoProcessor.from_pretrained(ckpt)


def _reference_rows(model, processor, rgb: np.ndarray) -> torch.Tensor:
    pixels = processor.image_processor(images=[[rgb]], return_tensors="pt")
    with torch.no_grad():
        out = model.get_image_features(
            pixel_values=pixels["pixel_values"],
            pixel_attention_mask=pixels["pixel_attention_mask"],
        )
    return torch.cat(list(out.pooler_output))  # [N, lm_hidden]


def _prompt(processor) -> str:
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    ]
    return processor.apply_chat_template(messages, add_generation_prompt=True)


def _expand(layout, placeholder: str) -> list[str]:
    return [p if isinstance(p, str) else placeholder * p for p in layout.pieces]


@pytest.mark.parametrize(("name", "grid"), [("astronaut", (3, 3)), ("chelsea", (2, 3))])
def test_rows_equal_get_image_features(family, reference, name, grid):
    model, processor = reference
    rgb = _photo(name)
    out = family.encode(rgb)
    ref = _reference_rows(model, processor, rgb)
    assert isinstance(out, Idefics3Output)
    assert out.grid == grid
    tiles = grid[0] * grid[1] + 1
    assert out.runs == [checkpoint.IMAGE_SEQ_LEN] * tiles
    assert out.embeds.shape == ref.shape == (tiles * checkpoint.IMAGE_SEQ_LEN, 64)
    assert out.embeds.dtype == torch.float32
    torch.testing.assert_close(out.embeds, ref, atol=1e-5, rtol=1e-5)
    assert out.mrope is None and out.mrope_advance == 0


def test_saliency_is_the_row_norm(family, reference, ckpt):
    model, processor = reference
    rgb = _photo("chelsea")
    out = family.encode(rgb)
    expected = _reference_rows(model, processor, rgb).norm(dim=-1)  # [N]
    torch.testing.assert_close(out.saliency, expected, atol=1e-5, rtol=1e-5)
    assert out.saliency.dtype == torch.float32
    # informative enough to rank rows, also when the tower runs in bfloat16
    assert float(out.saliency.std() / out.saliency.mean()) > 0.02
    half = load_family(ckpt, CPU, torch.bfloat16).encode(rgb).saliency
    assert float(torch.corrcoef(torch.stack([out.saliency, half]))[0, 1]) > 0.95


PROCESSOR_VARIANTS = [
    {"size": {"longest_edge": 192}, "max_image_size": {"longest_edge": 64}},
    {
        "size": {"longest_edge": 192},
        "max_image_size": {"longest_edge": 64},
        "do_image_splitting": False,
    },
    {
        "size": {"longest_edge": 100},
        "max_image_size": {"longest_edge": 48},
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "resample": 3,
    },
    {"do_resize": False, "max_image_size": {"longest_edge": 64}},
]
SIZES = [(1, 1), (1, 300), (7, 5), (64, 64), (65, 64), (100, 30), (191, 192), (500, 20), (77, 129)]


@pytest.mark.parametrize(
    "variant", PROCESSOR_VARIANTS, ids=["split", "nosplit", "clip", "noresize"]
)
def test_pixels_equal_the_slow_image_processor(variant):
    from transformers import Idefics3ImageProcessorPil

    processor = Idefics3ImageProcessorPil(**variant)
    spec = TileSpec.from_dict(processor.to_dict())
    lut = torch.from_numpy(spec.lookup_table())  # [3, 256]
    rng = np.random.default_rng(7)
    for height, width in SIZES:
        rgb = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        ref = processor(
            images=[[rgb]],
            return_tensors="pt",
            return_row_col_info=True,
            input_data_format="channels_last",
        )
        tiles, plan = preprocess(rgb, spec)  # [T, t, t, 3]
        idx = torch.from_numpy(tiles).permute(0, 3, 1, 2).long()
        mine = lut[torch.arange(3).view(1, 3, 1, 1), idx]  # [T, 3, t, t]
        assert (plan.rows, plan.cols) == (ref["rows"][0][0], ref["cols"][0][0]), (height, width)
        assert torch.equal(mine, ref["pixel_values"][0]), (variant, height, width)
        assert bool(ref["pixel_attention_mask"].all())


@pytest.mark.parametrize("name", ["astronaut", "chelsea"])
def test_layout_tokenizes_to_the_processor_ids(family, reference, name):
    _, processor = reference
    rgb = _photo(name)
    out = family.encode(rgb)
    layout = family.layout(list(out.runs), out)
    assert layout.placeholder == "<image>" == family.placeholder
    assert layout.rows == out.embeds.shape[0]
    _assert_processor_ids(processor, layout, rgb)


def _assert_processor_ids(processor, layout, rgb) -> None:
    text = _prompt(processor)
    expected = list(processor(text=text, images=[rgb])["input_ids"][0])
    before, after = text.split(layout.placeholder)
    pieces = _expand(layout, layout.placeholder)
    tok = processor.tokenizer
    assert tok(before + "".join(pieces) + after)["input_ids"] == expected
    # each piece on its own, as an engine tokenizes segments around embedding rows
    ids = tok(before)["input_ids"]
    for piece in pieces:
        ids += tok(piece, add_special_tokens=False)["input_ids"]
    ids += tok(after, add_special_tokens=False)["input_ids"]
    assert ids == expected


def test_unsplit_image_layout(ckpt, tmp_path):
    """do_image_splitting off: one squashed image, no tile markers."""
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    for path in ckpt.iterdir():
        shutil.copy(path, tmp_path / path.name)
    proc_cfg = json.loads((tmp_path / "processor_config.json").read_text())
    proc_cfg["image_processor"]["do_image_splitting"] = False
    (tmp_path / "processor_config.json").write_text(json.dumps(proc_cfg))
    fam = load_family(tmp_path, CPU, torch.float32)
    processor = AutoProcessor.from_pretrained(tmp_path)
    model = Idefics3ForConditionalGeneration.from_pretrained(tmp_path).eval()
    rgb = _photo("rocket")
    out = fam.encode(rgb)
    assert out.grid == (0, 0) and out.runs == [checkpoint.IMAGE_SEQ_LEN]
    torch.testing.assert_close(out.embeds, _reference_rows(model, processor, rgb))
    layout = fam.layout(out.runs, out)
    assert layout.pieces == (
        "<fake_token_around_image><global-img>",
        checkpoint.IMAGE_SEQ_LEN,
        "<fake_token_around_image>",
    )
    _assert_processor_ids(processor, layout, rgb)
    assert fam.describe() != load_family(ckpt, CPU, torch.float32).describe()


def test_layout_after_patch_dropping(family):
    out = family.encode(_photo("chelsea"))  # 2 x 3 tiles + global
    kept = [16, 0, 5, 9, 16, 1, 3]
    layout = family.layout(kept, out)
    assert layout.rows == sum(kept)
    assert [p for p in layout.pieces if isinstance(p, int)] == [k for k in kept if k]
    text = "".join(_expand(layout, "<image>"))
    assert text.count("<image>") == sum(kept)
    # the empty run leaves its marker; neighbouring markers merge into one text piece
    assert "<row_1_col_2><fake_token_around_image><row_1_col_3>" in text
    assert text.index("<row_2_col_3>") < text.index("\n\n<fake_token_around_image><global-img>")
    with pytest.raises(ValueError, match="runs"):
        family.layout(kept[:-1], out)
    with pytest.raises(ValueError, match="keeps 17 of 16"):
        family.layout([17, *kept[1:]], out)


def test_identity_and_description(family, ckpt):
    again = load_family(ckpt, CPU, torch.float32)
    assert again.weights_id == family.weights_id and len(family.weights_id) == 64
    desc = family.describe()
    assert json.loads(json.dumps(desc)) == desc
    assert describe_checkpoint(ckpt) == desc  # from the files alone, as remote gateways see it
    assert family.min_decode_side == 3 * checkpoint.TILE
    assert desc["tile"] == checkpoint.TILE and desc["tokens_per_tile"] == checkpoint.IMAGE_SEQ_LEN
    assert family.lm_hidden_size == 64 and family.name == "idefics3"


def test_reads_only_tower_and_connector_from_shards(ckpt, family, tmp_path):
    """A sharded copy with the language model's tensors removed still loads to the same
    encoder: the family never touches them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        keep = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(("model.text", "lm_"))}  # noqa: SIM118
    names = sorted(keep)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: keep[k] for k in keys}, str(tmp_path / fname), metadata={"format": "pt"})
    weight_map = {k: fname for fname, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for fname in ("config.json", "processor_config.json", "tokenizer_config.json"):
        shutil.copy(ckpt / fname, tmp_path / fname)
    slim = load_family(tmp_path, CPU, torch.float32)
    rgb = _photo("rocket")
    assert torch.equal(slim.encode(rgb).embeds, family.encode(rgb).embeds)
    assert slim.weights_id == checkpoint_id(tmp_path) != family.weights_id


def test_smolvlm_model_type(ckpt, tmp_path):
    from transformers import AutoProcessor, SmolVLMForConditionalGeneration

    for fname in ("config.json", "model.safetensors", "processor_config.json"):
        shutil.copy(ckpt / fname, tmp_path / fname)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "smolvlm"
    cfg["vision_config"]["model_type"] = "smolvlm_vision"
    cfg["architectures"] = ["SmolVLMForConditionalGeneration"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    fam = load_family(tmp_path, CPU, torch.float32)
    assert type(fam.tower).__name__ == "SmolVLMVisionTransformer"
    model = SmolVLMForConditionalGeneration.from_pretrained(tmp_path).eval()
    rgb = _photo("coffee")
    ref = _reference_rows(model, AutoProcessor.from_pretrained(ckpt), rgb)
    torch.testing.assert_close(fam.encode(rgb).embeds, ref, atol=1e-5, rtol=1e-5)


def test_unsupported_checkpoints(ckpt, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = tmp_path / "llama"
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(cfg).save_pretrained(llama)
    with pytest.raises(UnsupportedCheckpoint) as err:
        load_family(llama, CPU, torch.float32)
    message = str(err.value)
    assert "'llama'" in message
    for family_name in FAMILIES:
        assert family_name in message

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(ckpt / "config.json", pickled / "config.json")
    shutil.copy(ckpt / "processor_config.json", pickled / "processor_config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(UnsupportedCheckpoint, match="safetensors"):
        load_family(pickled, CPU, torch.float32)

    with pytest.raises(UnsupportedCheckpoint, match="config.json"):
        load_family(tmp_path / "missing", CPU, torch.float32)


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((8, 8), np.uint8),
        np.zeros((8, 8, 4), np.uint8),
        np.zeros((8, 8, 3), np.float32),
        np.zeros((0, 8, 3), np.uint8),
    ],
    ids=["gray", "rgba", "float", "empty"],
)
def test_bad_pixels_are_invalid_image(family, bad):
    with pytest.raises(ImageError) as err:
        family.encode(bad)
    assert err.value.code == "invalid_image"


# -- checkpoints built otherwise, through the project's whole path ------------------------------
#
# Each variant tiles and shuffles otherwise: no image splitting (the global image alone), a
# larger longest edge (more tiles) with a pixel shuffle of 4 (4 rows a tile), no pixel shuffle
# (64 rows a tile); the photos differ in size and aspect ratio (a 5:1 strip, a portrait crop, a
# small image, a grayscale photo). Rows and greedy answers must be transformers' own.
# The seeds are ones whose greedy steps all win by a logit margin over 0.01, a hundred times
# the 1e-4 the engine's logits are held to against the full model's (reordered float sums:
# the engine packs and chunks what generate computes in one pass).

MAX_NEW = 8
VARIANTS = {
    "nosplit": ({"seed": 3, "do_image_splitting": False}, ("strip", "tall")),
    "edge256-shuffle4": (
        {"seed": 3, "scale_factor": 4, "longest_edge": 4 * checkpoint.TILE},
        ("coffee", "camera"),
    ),
    "edge128-shuffle1": (
        {"seed": 2, "scale_factor": 1, "longest_edge": 2 * checkpoint.TILE},
        ("small", "chelsea"),
    ),
}


@functools.cache
def _variant(key: str, root: Path) -> tuple[list, list]:
    from tests.vlm_checkpoints import exactness

    options, names = VARIANTS[key]
    path = checkpoint.build(root / key, **options)
    photos = [exactness.shaped(n) for n in names]
    refs = exactness.reference("idefics3", path, photos, MAX_NEW)
    return refs, exactness.project_answers(path, photos, MAX_NEW)


@pytest.fixture(scope="module")
def variant_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("idefics3-variants")


@pytest.mark.parametrize("key", VARIANTS)
def test_variant_rows_and_answers_equal_transformers(key, variant_root) -> None:
    from tests.vlm_checkpoints.exactness import assert_same_answer

    options = VARIANTS[key][0]
    per_tile = (checkpoint.TILE // checkpoint.PATCH) ** 2 // options.get("scale_factor", 2) ** 2
    refs, ours = _variant(key, variant_root)
    for ref, got in zip(refs, ours, strict=True):
        assert got.rows.shape == ref.features.shape
        assert got.rows.shape[0] % per_tile == 0
        tiles = got.rows.shape[0] // per_tile
        assert tiles == 1 if not options.get("do_image_splitting", True) else tiles > 1
        torch.testing.assert_close(got.rows, ref.features, rtol=1e-5, atol=1e-5)
        assert got.tokens_kept == got.tokens_total == got.rows.shape[0]  # nothing dropped
        assert_same_answer(got, ref, MAX_NEW)
    assert refs[0].tokens != refs[1].tokens  # the photo moves the answer
