"""The contract of a real VLM family on the encoder side.

A family module turns decoded RGB pixels into the checkpoint's own visual tokens, exactly as the
checkpoint's transformers classes would (`Model.get_image_features` after its image
processor), split so that patch dropping can act on them:

    family = load_family(checkpoint_dir, device, dtype)     # safetensors only, nothing downloaded
    out = family.encode(rgb)                                 # rgb: [H, W, 3] uint8 numpy
    out.embeds      [N, lm_hidden]  visual tokens in the language model's embedding space
    out.saliency    [N]             higher = more important (for patch dropping)
    out.runs        [r0, r1, ...]   rows per run in prompt order (tiles, then the global image)
    out.mrope       [3, N] or None  (t, h, w) rotary position of each row relative to the image
    family.layout(kept_rows_per_run, out) -> ImageLayout   how the placeholder expands

Patch dropping keeps a subset of each run's rows (in order); the layout is then built from the
kept counts, and the kept rows' `mrope` columns (Qwen2.5-VL) keep their original positions.

Families register in `FAMILIES` by the `model_type` of the checkpoint's config.json.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch

    from encoder_worker.types import ImageLayout

__all__ = (
    "FAMILIES",
    "FamilyOutput",
    "UnsupportedCheckpoint",
    "VisionFamily",
    "detect_family",
    "load_family",
    "max_image_tokens",
)

# config.json model_type -> module under encoder_worker.families that implements it
FAMILIES: dict[str, str] = {
    "llava": "llava",
    "idefics3": "idefics3",
    "smolvlm": "idefics3",
    "qwen2_5_vl": "qwen2_5_vl",
}


class UnsupportedCheckpoint(ValueError):
    """The directory is not a checkpoint of a supported VLM family."""


@dataclass(slots=True)
class FamilyOutput:
    embeds: torch.Tensor  # [N, lm_hidden] float32, rows in prompt order
    saliency: torch.Tensor  # [N] float32
    runs: list[int]  # rows per run (tile) in prompt order; sums to N
    mrope: torch.Tensor | None = None  # [3, N] int64 (t, h, w) relative positions (Qwen2.5-VL)
    mrope_advance: int = 0  # text positions the (unpruned) image occupies (Qwen2.5-VL)


@runtime_checkable
class VisionFamily(Protocol):
    name: str  # "llava" | "idefics3" | "qwen2_5_vl"
    lm_hidden_size: int  # width of the rows it produces
    placeholder: str  # what the chat template renders for one image
    weights_id: str  # identity of the checkpoint (hash of its config and weight files)

    def describe(self) -> dict:
        """Everything that shapes the tokens besides the weights (preprocessing, feature layer,
        strategy...), JSON-able; it feeds the encoder fingerprint."""

    def encode(self, rgb: np.ndarray) -> FamilyOutput:
        """[H, W, 3] uint8 RGB -> the checkpoint's visual tokens for that image."""

    def layout(self, kept_per_run: list[int], out: FamilyOutput) -> ImageLayout:
        """How the placeholder expands when run i keeps `kept_per_run[i]` rows."""


def read_config(checkpoint_dir: str | Path) -> dict:
    path = Path(checkpoint_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedCheckpoint(f"{checkpoint_dir}: no readable config.json ({exc})") from None


def detect_family(checkpoint_dir: str | Path) -> str | None:
    """The family name of a VLM checkpoint, or None for a text-only / vision-only checkpoint."""
    model_type = read_config(checkpoint_dir).get("model_type", "")
    module = FAMILIES.get(model_type)
    return module


def load_family(
    checkpoint_dir: str | Path, device: torch.device, dtype: torch.dtype
) -> VisionFamily:
    """Build the family's encoder for a checkpoint.

    UnsupportedCheckpoint names what is supported.
    """
    config = read_config(checkpoint_dir)
    module = FAMILIES.get(config.get("model_type", ""))
    if module is None:
        supported = ", ".join(sorted(FAMILIES))
        raise UnsupportedCheckpoint(
            f"{checkpoint_dir}: model_type {config.get('model_type')!r} is not a supported "
            f"vision-language family (supported: {supported})"
        )
    mod = importlib.import_module(f"encoder_worker.families.{module}")
    return mod.Family(Path(checkpoint_dir), device, dtype)


def max_image_tokens(checkpoint_dir: str | Path, *, max_pixels: int) -> int:
    """The most visual tokens one image can put in the prompt (before patch dropping), from the
    checkpoint's files alone: what a gateway counts for an image it has not encoded yet (a key's
    token limits are charged the estimate first, so it errs high). `max_pixels` is the decode
    guard's limit (`EncoderConfig.max_pixels`), which bounds a processor that does not resize.
    LLaVA: the tower's patches; Idefics3: the tiles of the largest image the processor makes,
    plus the global image, times the tokens of a tile; Qwen2.5-VL: its `max_pixels` in merged
    patches, or more for the elongated images its resize clamps to one row."""
    module = detect_family(checkpoint_dir)
    if module is None:
        raise UnsupportedCheckpoint(f"{checkpoint_dir}: not a VLM checkpoint")
    mod = importlib.import_module(f"encoder_worker.families.{module}")
    return int(mod.max_image_tokens(Path(checkpoint_dir), max_pixels=max_pixels))
