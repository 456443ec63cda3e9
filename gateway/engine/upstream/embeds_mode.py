"""What embeds mode (`--upstream-images embeds`) needs of the encoder, checked before start.

In embeds mode the gateway's encoder runs the replica's own checkpoint and sends each image's
visual tokens as vLLM `image_embeds`. How the replica places them decides what the encoder may
do to them:

- M-RoPE checkpoints (Qwen2-VL, Qwen2.5-VL and their successors): vLLM gives every visual
  token its (t, h, w) position from the image's patch grid (`image_grid_thw`, which it also
  uses to size the placeholder), so it takes the whole grid, row for row. Patch dropping
  (`--pruning` other than none) leaves rows that fit no grid: every request with an image would
  fail. `embeds_problem` says so at start instead.
- The other supported families (LLaVA, Idefics3 / SmolVLM) place the rows they are given in
  order: pruned or not, any number of rows is a valid prompt.

Pure functions over config.json: no model is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ("MROPE_MODEL_TYPES", "embeds_problem", "is_mrope_checkpoint")

# config.json model_type of the checkpoints whose vision tokens carry (t, h, w) positions
MROPE_MODEL_TYPES = frozenset(
    {"qwen2_vl", "qwen2_5_vl", "qwen2_5_omni", "qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe"}
)


def is_mrope_checkpoint(checkpoint_dir: str | Path) -> bool:
    """Whether the checkpoint's vision tokens are placed by M-RoPE grids (False when its
    config.json cannot be read: the encoder's own load reports that)."""
    try:
        config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in MROPE_MODEL_TYPES


def embeds_problem(checkpoint_dir: str | Path, pruning: str) -> str | None:
    """Why embeds mode cannot work with this checkpoint and `--pruning`, or None when it can."""
    if pruning != "none" and is_mrope_checkpoint(checkpoint_dir):
        return (
            f"embeds mode with an M-RoPE checkpoint needs every visual token (the replica places "
            f"them by the image's patch grid), but --pruning {pruning} drops some: use "
            f"--pruning none, or --upstream-images data_url"
        )
    return None
