"""The vision tower: patch rows -> patch features at the feature layer, plus per-patch saliency.

`VisionTower` runs the weights of a transformers `CLIPVisionModel` or `SiglipVisionModel` with
its own short forward (patch embedding as a matmul over pre-cut patch rows, fused SDPA
attention in every layer) and stops at the feature layer: the layers after it are dropped at
load time, never run.

Saliency comes from the last layer that runs:
- CLIP (has a CLS token): the CLS row of that layer's attention, softmax(q_cls K^T / sqrt(d)),
  summed over heads. Only that one row is computed, beside the layer's own fused SDPA call,
  so no [T, T] attention map is ever materialized.
- SigLIP (no CLS token): the L2 norm of each output token.

`build_tower` makes the tower a config names: a seeded synthetic CLIP of ViT-B/16@224 or
ViT-L/14@336 shape (fast seeded normal init, no weights on disk), or a local checkpoint
directory (safetensors only: nothing is unpickled).
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from encoder_worker.patch_rows import PreprocessSpec

__all__ = (
    "SYNTHETIC_SHAPES",
    "TowerInfo",
    "TowerOutput",
    "VisionTower",
    "build_tower",
    "cls_attention_row",
    "describe_tower",
    "tower_grid",
)

# name -> (hidden, mlp, layers, heads, image size, patch size)
SYNTHETIC_SHAPES = {
    "vit-b16-224": (768, 3072, 12, 12, 224, 16),
    "vit-l14-336": (1024, 4096, 24, 16, 336, 14),
}
SYNTHETIC_INIT_STD = 0.02


class TowerOutput(NamedTuple):
    features: torch.Tensor  # [B, N, D] patch tokens at the feature layer (no CLS)
    saliency: torch.Tensor  # [B, N] float32, higher = more important
    keys: torch.Tensor  # [B, N, D] the saliency layer's keys (heads concatenated), for merging


def cls_attention_row(q_cls: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q_cls [B, H, Dh], k [B, H, T, Dh] -> CLS attention over all T tokens.

    The result is summed over heads: [B, T].
    """
    scale = q_cls.shape[-1] ** -0.5
    logits = torch.einsum("bhd,bhtd->bht", q_cls.float(), k.float()) * scale  # [B, H, T]
    return logits.softmax(dim=-1).sum(dim=1)


class VisionTower(nn.Module):
    """A CLIP / SigLIP vision encoder truncated at its feature layer."""

    def __init__(self, hf_model: nn.Module, kind: str, feature_layer: int) -> None:
        super().__init__()
        cfg = hf_model.config
        layers = hf_model.encoder.layers
        n_layers = len(layers)
        # hidden_states[i] is the output of i layers (0 = embeddings); run exactly that many
        run = feature_layer if feature_layer > 0 else n_layers + 1 + feature_layer
        if not 1 <= run <= n_layers:
            raise ValueError(f"feature_layer {feature_layer} is out of range for {n_layers} layers")
        emb = hf_model.embeddings
        self.kind = kind
        self.num_heads = cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size
        self.patch_size = cfg.patch_size
        self.image_size = cfg.image_size
        self.num_layers_run = run
        d = cfg.hidden_size
        self.patch_embed = nn.Linear(
            3 * cfg.patch_size**2, d, bias=emb.patch_embedding.bias is not None
        )
        with torch.no_grad():
            self.patch_embed.weight.copy_(emb.patch_embedding.weight.reshape(d, -1))  # [D, C*P*P]
            if emb.patch_embedding.bias is not None:
                self.patch_embed.bias.copy_(emb.patch_embedding.bias)
        self.has_cls = kind == "clip"
        self.class_embedding = (
            nn.Parameter(emb.class_embedding.detach().clone()) if self.has_cls else None
        )
        self.pos_embedding = nn.Parameter(emb.position_embedding.weight.detach().clone())  # [T, D]
        self.pre_norm = hf_model.pre_layrnorm if kind == "clip" else nn.Identity()
        self.layers = nn.ModuleList(list(layers)[:run])

    def _block(self, layer: nn.Module, x: torch.Tensor, saliency: bool):
        b, t, d = x.shape
        attn = layer.self_attn
        h = layer.layer_norm1(x)
        q = attn.q_proj(h).view(b, t, self.num_heads, -1).transpose(1, 2)  # [B, H, T, Dh]
        k = attn.k_proj(h).view(b, t, self.num_heads, -1).transpose(1, 2)  # [B, H, T, Dh]
        v = attn.v_proj(h).view(b, t, self.num_heads, -1).transpose(1, 2)  # [B, H, T, Dh]
        o = F.scaled_dot_product_attention(q, k, v)  # [B, H, T, Dh]
        x = x + attn.out_proj(o.transpose(1, 2).reshape(b, t, d))
        x = x + layer.mlp(layer.layer_norm2(x))
        if not saliency:
            return x, None, None
        row = cls_attention_row(q[:, :, 0], k) if self.has_cls else None  # [B, T]
        return x, row, k.transpose(1, 2).reshape(b, t, d)

    def forward(self, patches: torch.Tensor) -> TowerOutput:
        """patches [B, N, 3*P*P] -> TowerOutput."""
        b = patches.shape[0]
        x = self.patch_embed(patches)  # [B, N, D]
        if self.has_cls:
            cls = self.class_embedding.to(x.dtype).expand(b, 1, -1)  # [B, 1, D]
            x = torch.cat([cls, x], dim=1)  # [B, 1+N, D]
        x = self.pre_norm(x + self.pos_embedding.to(x.dtype))
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, row, keys = self._block(layer, x, saliency=i == last)
        start = 1 if self.has_cls else 0
        features = x[:, start:]  # [B, N, D]
        if row is not None:
            saliency = row[:, start:]  # [B, N]
        else:
            saliency = features.float().norm(dim=-1)  # [B, N]
        return TowerOutput(features, saliency, keys[:, start:])


def _synthetic_model(name: str, seed: int, feature_layer: int) -> nn.Module:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    d, mlp, n_layers, heads, size, patch = SYNTHETIC_SHAPES[name]
    cfg = CLIPVisionConfig(
        hidden_size=d,
        intermediate_size=mlp,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        image_size=size,
        patch_size=patch,
        hidden_act="quick_gelu",
    )
    with torch.device("meta"):
        model = CLIPVisionModel(cfg)
    model.encoder.layers = model.encoder.layers[: max(_absolute_layer(feature_layer, n_layers), 0)]
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.fill_(1.0 if pname.endswith("weight") else 0.0)
            elif pname.endswith("bias"):
                p.zero_()
            else:
                # a generator per tensor: weights do not depend on which layers were built
                g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(pname.encode()))
                p.normal_(0.0, SYNTHETIC_INIT_STD, generator=g)
    for pname, buf in model.named_buffers():
        if pname.endswith("position_ids"):
            buf.copy_(torch.arange(buf.shape[-1]).expand_as(buf))
    return model


def _checkpoint_id(path: str) -> str:
    """sha256 over the checkpoint's config and weight files."""
    h = hashlib.sha256()
    for fname in sorted(os.listdir(path)):
        if fname.endswith((".json", ".safetensors")):
            h.update(fname.encode())
            with open(os.path.join(path, fname), "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    return h.hexdigest()


class TowerInfo(NamedTuple):
    kind: str  # "clip" | "siglip"
    hidden_size: int
    num_layers: int
    spec: PreprocessSpec
    weights_id: str


def tower_grid(tower: str) -> int:
    """Patches along a side of the tower's input, from its name or config.json alone (no
    weights hashed: `describe_tower` names them too)."""
    if tower in SYNTHETIC_SHAPES:
        *_, size, patch = SYNTHETIC_SHAPES[tower]
        return size // patch
    try:
        with open(os.path.join(tower, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{tower}: cannot read config.json ({exc})") from None
    model_type = str(cfg.get("model_type") or "")
    if model_type in ("clip", "siglip"):
        cfg = cfg.get("vision_config") or {}
    size, patch = (224, 16) if model_type.startswith("siglip") else (224, 32)  # as describe_tower
    return int(cfg.get("image_size", size)) // int(cfg.get("patch_size", patch))


def describe_tower(tower: str, seed: int) -> TowerInfo:
    """What a tower is, from its name or its checkpoint's JSON files alone (no weights loaded)."""
    if tower in SYNTHETIC_SHAPES:
        d, _, n_layers, _, size, patch = SYNTHETIC_SHAPES[tower]
        weights_id = f"synthetic:{tower}:seed={seed}:std={SYNTHETIC_INIT_STD}"
        return TowerInfo(
            "clip", d, n_layers, PreprocessSpec(image_size=size, patch_size=patch), weights_id
        )
    cfg_path = os.path.join(tower, "config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{tower}: cannot read config.json ({exc})") from None
    model_type = cfg.get("model_type")
    if model_type in ("clip", "siglip"):
        cfg = cfg.get("vision_config") or {}
    kind = {
        "clip": "clip",
        "clip_vision_model": "clip",
        "siglip": "siglip",
        "siglip_vision_model": "siglip",
    }.get(model_type or "")
    if kind is None:
        raise ValueError(f"{tower}: unsupported vision model type {model_type!r} (CLIP or SigLIP)")
    defaults = {"clip": (768, 12, 224, 32), "siglip": (768, 12, 224, 16)}[kind]
    hidden = int(cfg.get("hidden_size", defaults[0]))
    n_layers = int(cfg.get("num_hidden_layers", defaults[1]))
    size = int(cfg.get("image_size", defaults[2]))
    patch = int(cfg.get("patch_size", defaults[3]))
    spec = _checkpoint_spec(tower, kind, size, patch)
    return TowerInfo(kind, hidden, n_layers, spec, f"{kind}:{_checkpoint_id(tower)}")


def _checkpoint_spec(path: str, kind: str, image_size: int, patch: int) -> PreprocessSpec:
    base = {"image_size": image_size, "patch_size": patch}
    if kind == "siglip":
        spec = PreprocessSpec(
            resize="squash", resample="bilinear", mean=(0.5,) * 3, std=(0.5,) * 3, **base
        )
    else:
        spec = PreprocessSpec(**base)
    pre = os.path.join(path, "preprocessor_config.json")
    if os.path.isfile(pre):
        with open(pre) as f:
            cfg = json.load(f)
        resample = {2: "bilinear", 3: "bicubic"}.get(cfg.get("resample"), spec.resample)
        size = cfg.get("size") or {}
        crop = "shortest_edge" in size and cfg.get("do_center_crop", True)
        spec = PreprocessSpec(
            resize="shortest_edge_crop" if crop else "squash",
            resample=resample,
            mean=tuple(cfg.get("image_mean", spec.mean)),
            std=tuple(cfg.get("image_std", spec.std)),
            **base,
        )
    return spec


def build_tower(tower: str, feature_layer: int, seed: int) -> tuple[VisionTower, TowerInfo]:
    """-> (the tower on CPU in float32, truncated at `feature_layer`; what it is)."""
    info = describe_tower(tower, seed)
    layer = _absolute_layer(feature_layer, info.num_layers)
    if tower in SYNTHETIC_SHAPES:
        model = _synthetic_model(tower, seed, feature_layer)
    else:
        from transformers import CLIPVisionModel, SiglipVisionModel

        cls = CLIPVisionModel if info.kind == "clip" else SiglipVisionModel
        model = cls.from_pretrained(
            tower, local_files_only=True, use_safetensors=True, dtype=torch.float32
        )
    vt = VisionTower(model, info.kind, layer)
    return vt.eval().requires_grad_(False), info


def _absolute_layer(feature_layer: int, n_layers: int) -> int:
    return feature_layer if feature_layer > 0 else n_layers + 1 + feature_layer
