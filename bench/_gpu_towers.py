"""The vision towers the GPU benchmark (`bench.gpu`) encodes with: their shapes, FLOP counts and
random-weight checkpoints.

`TOWERS` are the real shapes (CLIP ViT-L/14@336, SigLIP so400m-patch14-384), `QUICK_TOWERS` tiny
ones of the same two families for `--quick`. `random_checkpoint` writes a tower of a shape as a
local safetensors checkpoint, built from transformers' own configs, so the pipelines load it the
way they load a real one; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

__all__ = ("QUICK_TOWERS", "TOWERS", "TowerShape", "random_checkpoint", "tower_flops")


class TowerShape(NamedTuple):
    kind: str  # "clip" | "siglip"
    hidden: int
    mlp: int
    layers: int
    heads: int
    image: int
    patch: int

    @property
    def tokens(self) -> int:
        """Sequence length through the tower: the patches, plus CLIP's CLS token."""
        return (self.image // self.patch) ** 2 + (self.kind == "clip")


TOWERS = {
    "clip-vit-l14-336": TowerShape("clip", 1024, 4096, 24, 16, 336, 14),
    "siglip-so400m-14-384": TowerShape("siglip", 1152, 4304, 27, 16, 384, 14),
}
QUICK_TOWERS = {
    "clip-tiny": TowerShape("clip", 64, 256, 3, 4, 112, 14),
    "siglip-tiny": TowerShape("siglip", 72, 288, 3, 4, 112, 14),
}


def tower_flops(shape: TowerShape, layers_run: int, batch: int) -> int:
    """Multiply-adds x 2 of `VisionTower.forward` on `batch` images.

    Per layer and token: q, k, v and out projections (8 D^2), the MLP (4 D M), and attention
    scores plus the weighted sum (4 T D); plus the patch embedding (2 * 3P^2 * D per patch).
    The CLS saliency row (2 T D, once) and norms / activations are left out (< 0.1%)."""
    d, t, n = shape.hidden, shape.tokens, (shape.image // shape.patch) ** 2
    per_layer = t * (8 * d * d + 4 * d * shape.mlp + 4 * t * d)
    return batch * (n * 2 * 3 * shape.patch**2 * d + layers_run * per_layer)


def random_checkpoint(shape: TowerShape, path: Path, device: torch.device, seed: int = 0) -> Path:
    """A random-weight CLIP / SigLIP vision checkpoint of `shape`, written as safetensors.

    The model is made on the meta device and filled in place on `device` (normal(0, 0.02)
    weights, unit norms, zero biases), one pass instead of transformers' per-module
    initializers over 400M parameters; it is stored in bf16 to halve the bytes written, hashed
    (`describe_tower`) and read back."""
    from transformers import (
        CLIPVisionConfig,
        CLIPVisionModel,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    common = {
        "hidden_size": shape.hidden,
        "intermediate_size": shape.mlp,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "image_size": shape.image,
        "patch_size": shape.patch,
    }
    if shape.kind == "clip":
        cfg, cls = CLIPVisionConfig(hidden_act="quick_gelu", **common), CLIPVisionModel
    else:
        cfg, cls = SiglipVisionConfig(**common), SiglipVisionModel
    with torch.device("meta"):
        model = cls(cfg)
    model = model.to_empty(device=device)
    g = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
    model.to("cpu", torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path
