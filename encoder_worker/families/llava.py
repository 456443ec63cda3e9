"""LLaVA (`LlavaForConditionalGeneration`): the encoder side of a LLaVA checkpoint.

    rgb [H, W, 3] uint8
      -> the checkpoint's own image processor (PIL backend: CLIP shortest-edge resize, center
         crop, rescale, normalize, as read from its processor config)   pixel_values [1, 3, S, S]
      -> its vision tower (built from `vision_config`, run up to the deepest feature layer only)
      -> hidden_states[vision_feature_layer] (a list: those layers concatenated on the feature
         axis), CLS dropped under the "default" select strategy, kept under "full"
      -> multi_modal_projector                                            embeds [N, lm_hidden]

This is `LlavaModel.get_image_features` computed with transformers' own modules, so the rows
are those of the checkpoint to float rounding (bit-identical on the same device and dtype).
Only the vision tower's layers up to the feature layer and the projector are read from the
safetensors files, by key (transformers-5 `model.vision_tower.*` / `model.multi_modal_projector.*`
and the older `vision_tower.*` / `multi_modal_projector.*`, with or without a `vision_model.`
level); the language model is never built here.

Saliency: the CLS row of the deepest feature layer's attention (summed over heads) when the
tower has a CLS token, else the L2 norm of each output row. One run: the whole image.
Layout: the processor expands the image token into one copy per row, so the placeholder
becomes `(rows kept,)`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch

from encoder_worker.checkpoint import checkpoint_id, read_tensors, safetensors_index
from encoder_worker.families.family import FamilyOutput, UnsupportedCheckpoint
from encoder_worker.tower import cls_attention_row
from encoder_worker.types import ImageLayout

if TYPE_CHECKING:
    from torch import nn

__all__ = ("Family", "describe_checkpoint", "max_image_tokens")

log = structlog.get_logger("encoder_worker.families.llava")

_TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
# image-processor fields that shape pixel values (the rest is bookkeeping)
_PIXEL_FIELDS = (
    "do_resize",
    "size",
    "resample",
    "do_center_crop",
    "crop_size",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
)


def _load_config(path: Path):
    from transformers import LlavaConfig

    try:
        return LlavaConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UnsupportedCheckpoint(f"{path}: not a readable LLaVA config ({exc})") from None


def _image_token(path: Path, token_id: int) -> str:
    """The token string of `image_token_index`, from the tokenizer files (no tokenizer built)."""
    tok = path / "tokenizer.json"
    if tok.is_file():
        for added in json.loads(tok.read_text()).get("added_tokens", []):
            if added.get("id") == token_id:
                return str(added["content"])
    for name in ("processor_config.json", "preprocessor_config.json"):
        cfg = path / name
        if cfg.is_file():
            token = json.loads(cfg.read_text()).get("image_token")
            if token:
                return str(token)
    return "<image>"


def _feature_layers(config) -> tuple[list[int], bool]:
    """-> (absolute hidden-state indices, whether they are concatenated)."""
    layer = config.vision_feature_layer
    n = config.vision_config.num_hidden_layers
    layers = [layer] if isinstance(layer, int) else list(layer)
    absolute = [i if i >= 0 else n + 1 + i for i in layers]
    for i, a in zip(layers, absolute, strict=False):
        if not 0 <= a <= n:
            raise UnsupportedCheckpoint(f"vision_feature_layer {i} is out of range for {n} layers")
    return absolute, not isinstance(layer, int)


def _image_processor(path: Path):
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(path, backend="pil", local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UnsupportedCheckpoint(f"{path}: no usable image processor config ({exc})") from None


def describe_checkpoint(path: str | Path) -> dict:
    """What shapes the tokens besides the weights, from the checkpoint's files alone."""
    path = Path(path)
    config = _load_config(path)
    processor = _image_processor(path).to_dict()
    return {
        "family": "llava",
        "vision_model": config.vision_config.model_type,
        "feature_layer": config.vision_feature_layer,
        "select_strategy": config.vision_feature_select_strategy,
        "image_processor": {k: processor.get(k) for k in _PIXEL_FIELDS},
        "image_token": _image_token(path, config.image_token_index),
    }


def max_image_tokens(path: Path, *, max_pixels: int = 0) -> int:
    """Every image is one tower input of `image_size` px: its patches, less the CLS row under
    the "default" select strategy."""
    config = _load_config(path)
    vision = config.vision_config
    patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
    return patches if config.vision_feature_select_strategy == "default" else patches + 1


def _resolve_prefix(index: dict, prefixes: tuple[str, ...], probe: str, levels=("",)) -> str:
    for prefix in prefixes:
        for level in levels:
            if prefix + level + probe in index:
                return prefix + level
    raise UnsupportedCheckpoint(
        f"no weight named like {prefixes[0]}{probe} (tried {', '.join(prefixes)})"
    )


class Family:
    """The LLaVA encoder of one checkpoint on one device (see the module doc)."""

    name = "llava"

    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.path = Path(path)
        self.device = torch.device(device)
        self.dtype = dtype
        config = _load_config(self.path)
        self.config = config
        vc = config.vision_config
        self.layers, self.concat = _feature_layers(config)
        self.strategy = config.vision_feature_select_strategy
        if self.strategy not in ("default", "full"):
            raise UnsupportedCheckpoint(f"unknown vision_feature_select_strategy {self.strategy!r}")
        self.lm_hidden_size = int(config.text_config.hidden_size)
        self.placeholder = _image_token(self.path, config.image_token_index)
        self.processor = _image_processor(self.path)
        self.min_decode_side = int(min(_sizes(self.processor.to_dict())) or 0)
        self._describe = describe_checkpoint(self.path)
        self.weights_id = checkpoint_id(self.path)

        run = max(self.layers)  # layers after the deepest feature layer are never built
        with torch.device("meta"):
            tower = AutoModel.from_config(vc)
            projector = LlavaMultiModalProjector(config)
        tower.encoder.layers = tower.encoder.layers[:run]
        self.tower = self._load(tower, _TOWER_PREFIXES, ("", "vision_model."))
        self.projector = self._load(projector, _PROJECTOR_PREFIXES, ("",))
        self.has_cls = hasattr(getattr(tower, "embeddings", None), "class_embedding")
        self._captured: dict[str, torch.Tensor] = {}
        self._hooked = self._hook_saliency(run)
        log.info(
            "family.loaded",
            family=self.name,
            path=str(self.path),
            device=str(self.device),
            dtype=str(dtype),
            vision=vc.model_type,
            layers_run=run,
            lm_hidden=self.lm_hidden_size,
            feature_layer=config.vision_feature_layer,
            strategy=self.strategy,
        )

    # -- loading ------------------------------------------------------------------------------

    def _load(
        self, module: nn.Module, prefixes: tuple[str, ...], levels: tuple[str, ...]
    ) -> nn.Module:
        """Materialize `module` (built on meta) from the checkpoint's tensors, by key."""
        index = safetensors_index(self.path)
        names = list(module.state_dict())
        prefix = _resolve_prefix(index, prefixes, names[0], levels)
        tensors = read_tensors(self.path, [prefix + k for k in names])
        module = module.to_empty(device="cpu")
        module.load_state_dict({k: tensors[prefix + k] for k in names}, strict=True)
        for name, buf in module.named_buffers():
            if name.endswith("position_ids"):  # non-persistent: not in the file
                buf.copy_(torch.arange(buf.shape[-1]).expand_as(buf))
        return module.to(self.device, self.dtype).eval().requires_grad_(False)

    def _hook_saliency(self, run: int) -> bool:
        if not self.has_cls:
            return False
        attn = getattr(self.tower.encoder.layers[run - 1], "self_attn", None)
        q, k = getattr(attn, "q_proj", None), getattr(attn, "k_proj", None)
        if q is None or k is None:
            return False
        self._heads = int(attn.num_heads)

        def keep(name: str):
            def hook(_module, _inputs, output) -> None:
                self._captured[name] = output

            return hook

        q.register_forward_hook(keep("q"))
        k.register_forward_hook(keep("k"))
        return True

    # -- the contract -------------------------------------------------------------------------

    def describe(self) -> dict:
        return dict(self._describe)

    def pixel_values(self, rgb: np.ndarray) -> torch.Tensor:
        """[H, W, 3] uint8 -> [1, 3, S, S] float32, by the checkpoint's own image processor."""
        return self.processor(images=rgb, return_tensors="pt")["pixel_values"]

    @torch.inference_mode()
    def encode(self, rgb: np.ndarray) -> FamilyOutput:
        pixels = self.pixel_values(rgb).to(self.device, self.dtype)  # [1, 3, S, S]
        self._captured.clear()
        out = self.tower(pixels, output_hidden_states=True)
        states = out.hidden_states  # embeddings, then one per layer run
        picked = [states[i] for i in self.layers]  # each [1, T, Dv]
        if self.strategy == "default":
            picked = [h[:, 1:] for h in picked]
        features = torch.cat(picked, dim=-1) if self.concat else picked[0]  # [1, N, Dv*]
        embeds = self.projector(features)[0].float()  # [N, lm_hidden]
        saliency = self._saliency(features[0], skip=1 if self.strategy == "default" else 0)
        self._captured.clear()
        return FamilyOutput(embeds=embeds, saliency=saliency, runs=[int(embeds.shape[0])])

    def _saliency(self, features: torch.Tensor, skip: int) -> torch.Tensor:
        """[N] CLS attention of the deepest feature layer over the kept rows, else row L2 norms."""
        if self._hooked and "q" in self._captured and "k" in self._captured:
            q, k = self._captured["q"], self._captured["k"]  # [1, T, D]
            b, t, d = k.shape
            h = self._heads
            q_cls = q[:, 0].reshape(b, h, d // h)  # [1, H, Dh]
            keys = k.reshape(b, t, h, d // h).transpose(1, 2)  # [1, H, T, Dh]
            return cls_attention_row(q_cls, keys)[0, skip:].float()  # [N]
        return features.float().norm(dim=-1)  # [N]

    def layout(self, kept_per_run: list[int], out: FamilyOutput) -> ImageLayout:
        if len(kept_per_run) != 1:
            raise ValueError(f"LLaVA images are one run, got {len(kept_per_run)} counts")
        kept = int(kept_per_run[0])
        if not 0 < kept <= sum(out.runs):
            raise ValueError(f"kept rows {kept} not in 1..{sum(out.runs)}")
        return ImageLayout(placeholder=self.placeholder, pieces=(kept,))


def _sizes(processor: dict) -> list[int]:
    size = processor.get("size") or {}
    crop = processor.get("crop_size") or {}
    values = [
        v
        for v in (
            size.get("shortest_edge"),
            size.get("height"),
            size.get("width"),
            crop.get("height"),
            crop.get("width"),
        )
        if isinstance(v, int)
    ]
    return values or [0]
