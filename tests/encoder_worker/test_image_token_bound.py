"""`max_image_tokens`, read from a checkpoint's files, against transformers' own processors on
tiny random-weight checkpoints of each family: no image makes more image tokens in the
processor's prompt than the bound, and the largest image the processor allows makes exactly
that many (the bound is tight). The gateway charges a key's token limits this estimate for an
image it has not encoded yet, so one that fell short would let concurrent responses past it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from encoder_worker.config import EncoderConfig
from encoder_worker.families.family import UnsupportedCheckpoint, max_image_tokens
from tests.vlm_checkpoints import exactness, idefics3, llava, qwen2_5_vl

SQUARE = (1024, 1024)
# the most elongated image Qwen2.5-VL's processor takes (200:1): its resize clamps the short
# side to one merged patch and keeps the long side at sqrt(max_pixels * 200)
STRIP = (28, 28 * 200)
# family, builder options, the image token the processor expands the placeholder into, and
# the (height, width) of an image that makes the most tokens: for LLaVA and Idefics3 a square
# past every size the processor resizes to; for Qwen2.5-VL the strip (89 rows of one against
# max_pixels' 40; 63 against 20)
VARIANTS = {
    "llava-default": ("llava", {}, "<image>", SQUARE),
    "llava-full": ("llava", {"select_strategy": "full"}, "<image>", SQUARE),
    "idefics3-split": ("idefics3", {}, "<image>", SQUARE),
    "idefics3-nosplit": ("idefics3", {"do_image_splitting": False}, "<image>", SQUARE),
    "idefics3-edge256": ("idefics3", {"longest_edge": 256}, "<image>", SQUARE),
    "qwen2_5_vl": ("qwen2_5_vl", {}, "<|image_pad|>", STRIP),
    "qwen2_5_vl-max20": ("qwen2_5_vl", {"max_pixels": 28 * 28 * 20}, "<|image_pad|>", STRIP),
}
BUILDERS = {"llava": llava, "idefics3": idefics3, "qwen2_5_vl": qwen2_5_vl}
MAX_PIXELS = EncoderConfig().max_pixels
PHOTOS = ("astronaut", "coffee", "tall", "strip", "small")


def image_tokens(family: str, path: Path, token: str, rgb: np.ndarray) -> int:
    """How many `token`s transformers' processor puts in the prompt for one image."""
    processor = exactness._processor(family, path)
    text = processor.apply_chat_template(
        exactness._conversation(exactness.QUESTION), add_generation_prompt=True, tokenize=False
    )
    image = Image.open(io.BytesIO(exactness.png(rgb))).convert("RGB")
    images = [[image]] if family == "idefics3" else [image]
    ids = processor(text=text, images=images, return_tensors="pt")["input_ids"][0].tolist()
    return ids.count(processor.tokenizer.convert_tokens_to_ids(token))


@pytest.mark.parametrize("key", VARIANTS)
def test_no_image_makes_more_tokens_than_the_bound_and_the_largest_makes_it(key, tmp_path) -> None:
    family, options, token, (height, width) = VARIANTS[key]
    path = BUILDERS[family].build(tmp_path / key, **options)
    bound = max_image_tokens(path, max_pixels=MAX_PIXELS)
    counts = {name: image_tokens(family, path, token, exactness.shaped(name)) for name in PHOTOS}
    assert all(0 < n <= bound for n in counts.values()), (bound, counts)
    largest = np.asarray(Image.fromarray(exactness.shaped("astronaut")).resize((width, height)))
    assert image_tokens(family, path, token, largest) == bound, (bound, counts)


def test_idefics3_without_resizing_is_bounded_by_the_decode_guard(tmp_path) -> None:
    """Not resized, an image keeps its size: only the decode guard's pixel limit bounds its
    tiles. Every shape at that limit, through the family's own tile plan (equal to the
    processor's, test_family_idefics3), makes no more."""
    from encoder_worker.families.idefics3 import TileSpec, plan_tiles

    path = idefics3.build(tmp_path / "noresize")
    processor = json.loads((path / "processor_config.json").read_text())
    config = processor["image_processor"]
    config["do_resize"] = False
    (path / "processor_config.json").write_text(json.dumps(processor))
    limit = 64 * 64 * 12  # twelve tiles' pixels
    bound = max_image_tokens(path, max_pixels=limit)
    spec = TileSpec.from_dict(config)
    most = max(plan_tiles(h, limit // h, spec).tiles for h in range(1, limit + 1))
    assert most * idefics3.IMAGE_SEQ_LEN <= bound <= 2 * most * idefics3.IMAGE_SEQ_LEN


def test_a_language_model_has_no_image_bound(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(UnsupportedCheckpoint):
        max_image_tokens(tmp_path, max_pixels=MAX_PIXELS)


def test_the_built_in_towers_bound_is_their_patches() -> None:
    assert EncoderConfig(tower="vit-b16-224").max_image_tokens == 196
    assert EncoderConfig(tower="vit-l14-336", pruning="none").max_image_tokens == 576
