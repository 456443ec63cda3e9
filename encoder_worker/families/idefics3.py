"""Idefics3 / SmolVLM on the encoder side: tiles, SigLIP-style tower, pixel-shuffle connector.

`Family(path, device, dtype)` serves a checkpoint whose config.json has model_type "idefics3"
(Idefics3ForConditionalGeneration: Idefics3, SmolVLM-256M/500M/2B) or "smolvlm"
(SmolVLMForConditionalGeneration: SmolVLM2). Its rows equal the model's own
`get_image_features(pixel_values, pixel_attention_mask)` after the checkpoint's own image
processor, in the same order:

    preprocess  the slow (PIL) Idefics3 image processor's steps, reproduced to the pixel:
                LANCZOS resize of the longest edge to size["longest_edge"] (even short side),
                then up to multiples of the tile (max_image_size["longest_edge"]); when that is
                larger than one tile, row-major tiles plus the whole image squashed to one tile
                (the global image); rescale (float64, then float32) and normalize (float32),
                applied here as one exact per-channel 256-entry lookup table on the device.
    tower       Idefics3VisionTransformer / SmolVLMVisionTransformer built from
                config.vision_config, weights read by key from the safetensors files.
    connector   pixel shuffle by config.scale_factor, then modality_projection (no bias).

runs: one per tile, image_seq_len rows each, tiles row-major then the global image.
saliency: the L2 norm of each output row (float32), i.e. how strongly the row drives the LM's
input. The tower's own token norms are no use here: its last step is a LayerNorm, which leaves
every patch with nearly the same norm.

Only the vision tower and connector weights are read (`safetensors.safe_open`); the language
model is never instantiated. Nothing is unpickled and nothing is downloaded.

Out of scope: an image that decodes to an all-zero normalized tile (the reference drops such
tiles as batch padding; with mean 0.5 / std 0.5 no uint8 pixel normalizes to exactly 0).

One module, as each family is (`llava.py`, `qwen2_5_vl.py`): the tile plan,
the preprocessing and the connector reproduce one checkpoint format step for step, and are
checked together against that format's reference, so they are read together.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch
from PIL import Image
from torch import nn

from encoder_worker.checkpoint import checkpoint_id, read_tensors, safetensors_index
from encoder_worker.families.family import FamilyOutput, UnsupportedCheckpoint, read_config
from encoder_worker.types import ImageError, ImageLayout

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = (
    "MAX_IMAGE_SIDE",
    "Family",
    "Idefics3Output",
    "TileSpec",
    "describe_checkpoint",
    "expand_image",
    "max_image_tokens",
    "pixel_shuffle",
    "plan_tiles",
    "preprocess",
)

log = structlog.get_logger("encoder_worker.families.idefics3")

MAX_IMAGE_SIDE = 4096  # the processor's absolute cap on either side after the first resize

# config model_type -> (transformers module, vision tower class)
_TOWERS = {
    "idefics3": ("transformers.models.idefics3.modeling_idefics3", "Idefics3VisionTransformer"),
    "smolvlm": ("transformers.models.smolvlm.modeling_smolvlm", "SmolVLMVisionTransformer"),
}
# where a checkpoint keeps the tower and connector: "model." for *ForConditionalGeneration
# (every transformers version), "" for a bare Idefics3Model / SmolVLMModel save
_MODEL_PREFIXES = ("model.", "")
_CONNECTOR_KEY = "connector.modality_projection.proj.weight"


@dataclass(frozen=True, slots=True)
class TileSpec:
    """The image processor settings that shape the pixels (from the checkpoint's config)."""

    tile: int  # max_image_size["longest_edge"]: side of every tile fed to the tower
    longest_edge: int | None  # size["longest_edge"]; None when size gives height and width
    size_hw: tuple[int, int] | None  # size["height"], size["width"]
    do_resize: bool
    do_image_splitting: bool
    resample: int  # PIL resampling filter (1 = LANCZOS)
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @classmethod
    def from_dict(cls, cfg: dict) -> TileSpec:
        size = cfg.get("size") or {"longest_edge": 4 * 364}
        mean = cfg.get("image_mean", 0.5)
        std = cfg.get("image_std", 0.5)
        return cls(
            tile=int((cfg.get("max_image_size") or {"longest_edge": 364})["longest_edge"]),
            longest_edge=int(size["longest_edge"]) if size.get("longest_edge") else None,
            size_hw=(int(size["height"]), int(size["width"])) if size.get("height") else None,
            do_resize=bool(cfg.get("do_resize", True)),
            do_image_splitting=bool(cfg.get("do_image_splitting", True)),
            resample=int(cfg.get("resample", Image.Resampling.LANCZOS)),
            do_rescale=bool(cfg.get("do_rescale", True)),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            do_normalize=bool(cfg.get("do_normalize", True)),
            image_mean=_triple(mean),
            image_std=_triple(std),
        )

    def lookup_table(self) -> np.ndarray:
        """[3, 256] float32: uint8 value -> rescaled, normalized value, per channel, computed
        with the processor's own dtypes (value * factor in float64, cast to float32, then
        (x - mean) / std in float32), so a gather reproduces its output bit for bit."""
        values = np.arange(256, dtype=np.uint8)
        x = values.astype(np.float32)
        if self.do_rescale:
            x = (values.astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = np.stack([x, x, x])  # [3, 256]
        if self.do_normalize:
            mean = np.asarray(self.image_mean, np.float32)[:, None]
            x = (x - mean) / np.asarray(self.image_std, np.float32)[:, None]
        return x


def _triple(v: float | Iterable[float]) -> tuple[float, float, float]:
    vals = [float(v)] * 3 if isinstance(v, (int, float)) else [float(x) for x in v]
    if len(vals) != 3:
        raise UnsupportedCheckpoint(f"image mean/std must have 3 channels, got {vals}")
    return vals[0], vals[1], vals[2]


def _fit_longest_edge(height: int, width: int, max_len: int) -> tuple[int, int]:
    """The longest edge becomes max_len (up or down), aspect kept, short side rounded up to
    even; then both sides capped at MAX_IMAGE_SIDE (aspect kept)."""
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIDE:
        width, height = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE / aspect)
    elif height > width and height > MAX_IMAGE_SIDE:
        height, width = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE * aspect)
    return max(height, 1), max(width, 1)


def _round_up_to_tiles(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both sides up to multiples of the tile; the short side is first re-derived from the
    long one's rounded value, as the processor does."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


@dataclass(frozen=True, slots=True)
class TilePlan:
    resized: tuple[int, int] | None  # (h, w) after the first resize; None: no resize
    fitted: tuple[int, int] | None  # (h, w) rounded up to whole tiles; None: no splitting
    rows: int  # tile rows (0 when the image is one tile or splitting is off)
    cols: int

    @property
    def tiles(self) -> int:
        """Images fed to the tower: rows * cols tiles plus the global image (or just one)."""
        return self.rows * self.cols + 1 if self.rows else 1


def plan_tiles(height: int, width: int, spec: TileSpec) -> TilePlan:
    """The sizes the processor resizes an image of height x width to, and its tile grid."""
    resized = None
    if spec.do_resize:
        if spec.longest_edge:
            resized = _fit_longest_edge(height, width, spec.longest_edge)
        elif spec.size_hw:
            resized = spec.size_hw
        else:
            raise UnsupportedCheckpoint("image processor size needs longest_edge or height+width")
        height, width = resized
    if not spec.do_image_splitting:
        return TilePlan(resized, None, 0, 0)
    fitted = _round_up_to_tiles(height, width, spec.tile)
    if fitted[0] > spec.tile or fitted[1] > spec.tile:
        return TilePlan(resized, fitted, fitted[0] // spec.tile, fitted[1] // spec.tile)
    return TilePlan(resized, fitted, 0, 0)


def preprocess(rgb: np.ndarray, spec: TileSpec) -> tuple[np.ndarray, TilePlan]:
    """[H, W, 3] uint8 -> ([T, tile, tile, 3] uint8 tiles in tower order, plan). Resizing is
    PIL's, with the processor's filter, on uint8 images, exactly as the processor chains it."""
    plan = plan_tiles(rgb.shape[0], rgb.shape[1], spec)
    image = Image.fromarray(rgb)
    resample = Image.Resampling(spec.resample)
    t = spec.tile
    if plan.resized is not None:
        image = image.resize((plan.resized[1], plan.resized[0]), resample=resample)
    if plan.fitted is None:  # no splitting: one image squashed to a tile
        return np.array(image.resize((t, t), resample=resample))[None], plan
    image = image.resize((plan.fitted[1], plan.fitted[0]), resample=resample)
    if not plan.rows:  # exactly one tile
        return np.array(image)[None], plan
    full = np.asarray(image)  # [rows * t, cols * t, 3]
    tiles = [
        full[r * t : (r + 1) * t, c * t : (c + 1) * t]
        for r in range(plan.rows)
        for c in range(plan.cols)
    ]
    tiles.append(np.asarray(image.resize((t, t), resample=resample)))  # the global image
    return np.stack(tiles), plan


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[T, S*S, D] -> [T, S*S/scale^2, D*scale^2]: each output token stacks a scale x scale
    block of neighbouring patches (the connector's own element order)."""
    n, seq, dim = x.shape
    side = math.isqrt(seq)
    x = x.reshape(n, side, side // scale, dim * scale)  # [T, H, W/s, D*s]
    x = x.permute(0, 2, 1, 3)  # [T, W/s, H, D*s]
    x = x.reshape(n, side // scale, side // scale, dim * scale * scale)  # [T, W/s, H/s, D*s*s]
    x = x.permute(0, 2, 1, 3)  # [T, H/s, W/s, D*s*s]
    return x.reshape(n, seq // (scale * scale), dim * scale * scale)


def expand_image(
    rows: int,
    cols: int,
    kept_per_run: list[int],
    *,
    fake: str = "<fake_token_around_image>",
    global_tag: str = "<global-img>",
) -> tuple[str | int, ...]:
    """The processor's expansion of one image with each tile's run of image tokens replaced
    by its kept row count; adjacent text is merged and empty runs left out."""
    parts: list[str | int] = []
    if rows == 0:
        parts += [fake + global_tag, kept_per_run[0], fake]
    else:
        run = 0
        for r in range(rows):
            for c in range(cols):
                parts += [f"{fake}<row_{r + 1}_col_{c + 1}>", kept_per_run[run]]
                run += 1
            parts.append("\n")
        parts += [f"\n{fake}{global_tag}", kept_per_run[run], fake]
    merged: list[str | int] = []
    for part in parts:
        if isinstance(part, str) and merged and isinstance(merged[-1], str):
            merged[-1] += part
        elif part != 0:
            merged.append(part)
    return tuple(merged)


@dataclass(slots=True)
class Idefics3Output(FamilyOutput):
    """`FamilyOutput` plus the tile grid, which the layout needs (0 x 0: one image, no tiles)."""

    grid: tuple[int, int] = (0, 0)


def _processor_configs(path: Path) -> tuple[dict, dict]:
    """(image processor settings, processor settings) in either on-disk layout: nested in
    processor_config.json (transformers 5) or a separate preprocessor_config.json."""
    proc: dict = {}
    if (path / "processor_config.json").is_file():
        proc = json.loads((path / "processor_config.json").read_text())
    image = proc.get("image_processor")
    if not image and (path / "preprocessor_config.json").is_file():
        image = json.loads((path / "preprocessor_config.json").read_text())
    if not image:
        raise UnsupportedCheckpoint(f"{path}: no image processor config")
    return image, proc


def _special_tokens(path: Path) -> dict[str, str]:
    """The processor's marker strings (SmolVLM tokenizers may name their own)."""
    names = {
        "image_token": "<image>",
        "fake_image_token": "<fake_token_around_image>",
        "global_image_token": "<global-img>",
    }
    cfg_path = path / "tokenizer_config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        extra = cfg.get("extra_special_tokens")
        for source in (cfg, extra if isinstance(extra, dict) else {}):
            for key in names:
                if isinstance(source.get(key), str):
                    names[key] = source[key]
    return names


def _read_encoder_weights(path: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(tower state dict, connector weight [lm_hidden, D*s*s]): only these tensors are read,
    by key, from the safetensors files."""
    try:
        index = safetensors_index(path)
    except ValueError as exc:
        raise UnsupportedCheckpoint(str(exc)) from None
    prefix = next((p for p in _MODEL_PREFIXES if p + _CONNECTOR_KEY in index), None)
    if prefix is None:
        raise UnsupportedCheckpoint(f"{path}: no {_CONNECTOR_KEY} in the safetensors files")
    tower_prefix = prefix + "vision_model."
    wanted = [k for k in index if k.startswith(tower_prefix)] + [prefix + _CONNECTOR_KEY]
    tensors = read_tensors(path, wanted)
    connector = tensors.pop(prefix + _CONNECTOR_KEY)
    return {k[len(tower_prefix) :]: v for k, v in tensors.items()}, connector


@dataclass(frozen=True, slots=True)
class _Settings:
    """What the checkpoint's files say besides the weights (no model is built)."""

    model_type: str
    config: object  # the transformers config (Idefics3Config / SmolVLMConfig)
    spec: TileSpec
    scale: int
    patch: int
    image_seq_len: int
    tokens: dict[str, str]

    @classmethod
    def read(cls, path: Path) -> _Settings:
        from transformers import AutoConfig

        model_type = read_config(path).get("model_type")
        if model_type not in _TOWERS:
            raise UnsupportedCheckpoint(
                f"{path}: model_type {model_type!r} is not idefics3/smolvlm"
            )
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        image_cfg, proc_cfg = _processor_configs(path)
        spec = TileSpec.from_dict(image_cfg)
        scale, patch = int(config.scale_factor), int(config.vision_config.patch_size)
        side = spec.tile // patch
        if spec.tile % patch or side % scale:
            raise UnsupportedCheckpoint(
                f"{path}: tile {spec.tile} px is not a whole number of {patch} px patches "
                f"divisible by scale_factor {scale}"
            )
        seq = side * side // scale**2
        declared = proc_cfg.get("image_seq_len")
        if declared is not None and int(declared) != seq:
            raise UnsupportedCheckpoint(
                f"{path}: processor image_seq_len {declared} != {seq} tokens that a "
                f"{spec.tile} px tile makes ({patch} px patches, scale {scale})"
            )
        return cls(model_type, config, spec, scale, patch, seq, _special_tokens(path))

    def describe(self) -> dict:
        spec = self.spec
        return {
            "family": "idefics3",
            "model_type": self.model_type,
            "tile": spec.tile,
            "longest_edge": spec.longest_edge,
            "size_hw": list(spec.size_hw) if spec.size_hw else None,
            "do_resize": spec.do_resize,
            "do_image_splitting": spec.do_image_splitting,
            "resample": spec.resample,
            "rescale": spec.rescale_factor if spec.do_rescale else None,
            "mean": list(spec.image_mean) if spec.do_normalize else None,
            "std": list(spec.image_std) if spec.do_normalize else None,
            "scale_factor": self.scale,
            "tokens_per_tile": self.image_seq_len,
            "tokens": dict(self.tokens),
            "saliency": "row-l2-norm",
        }


def describe_checkpoint(path: str | Path) -> dict:
    """`Family.describe()` of the checkpoint, from its files alone."""
    return _Settings.read(Path(path)).describe()


def max_image_tokens(path: Path, *, max_pixels: int) -> int:
    """The most tiles an image makes, times a tile's tokens. Resized, no image makes more than
    a square as large as the processor lets one be (its `longest_edge`, or the larger side of a
    fixed size): a side rounds up to at most as many tiles as the longest. Not resized, an
    image keeps its own size, bounded only by `max_pixels` (the decode guard): the most tiles
    of r rows is r + 1 (the short side's rounding may add a row) times the columns of the
    widest image r rows allow, plus the global image."""
    settings = _Settings.read(path)
    spec = settings.spec
    if not spec.do_image_splitting:  # one image, squashed to a tile
        return settings.image_seq_len
    if spec.do_resize:
        if spec.longest_edge:
            side = min(spec.longest_edge, MAX_IMAGE_SIDE)
        else:
            side = max(spec.size_hw or (spec.tile,))
        return plan_tiles(side, side, spec).tiles * settings.image_seq_len
    t, most = spec.tile, 1
    for rows in range(1, max_pixels // t + 2):
        tallest_short = (rows - 1) * t + 1  # the least height that needs `rows` rows
        if tallest_short > max_pixels:
            break
        cols = math.ceil((max_pixels // tallest_short) / t)
        most = max(most, (rows + 1) * cols + 1)
    return most * settings.image_seq_len


class Family:
    """The Idefics3 / SmolVLM encoder side (see the module docstring)."""

    name = "idefics3"

    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype) -> None:
        import importlib

        path = Path(path)
        settings = _Settings.read(path)
        self.settings, self.spec = settings, settings.spec
        self.scale, self.patch = settings.scale, settings.patch
        self.image_seq_len = settings.image_seq_len
        self.tokens = settings.tokens
        self.placeholder = self.tokens["image_token"]
        spec = self.spec
        # decoding may shrink a photo down to twice this shorter side, so the processor's
        # own first resize still only shrinks it (0: the processor keeps native resolution)
        fit = spec.longest_edge or max(spec.size_hw or (0,))
        self.min_decode_side = fit if spec.do_resize else 0

        state, connector = _read_encoder_weights(path)
        vcfg = settings.config.vision_config
        module_name, class_name = _TOWERS[settings.model_type]
        tower_cls = getattr(importlib.import_module(module_name), class_name)
        vcfg._attn_implementation = "sdpa"
        with torch.device("meta"):
            tower = tower_cls(vcfg)
        missing, unexpected = tower.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise UnsupportedCheckpoint(
                f"{path}: vision tower weights do not match its config "
                f"(missing {missing[:4]}, unexpected {unexpected[:4]})"
            )
        if connector.shape[1] != int(vcfg.hidden_size) * self.scale**2:
            raise UnsupportedCheckpoint(f"{path}: connector width does not match the tower")
        self.tower = tower.to(device=device, dtype=dtype).eval()
        self.projection = nn.Linear(connector.shape[1], connector.shape[0], bias=False)
        self.projection.weight = nn.Parameter(connector, requires_grad=False)
        self.projection = self.projection.to(device=device, dtype=dtype).eval()
        self.lm_hidden_size = int(connector.shape[0])
        self.device, self.dtype = torch.device(device), dtype
        self._lut = torch.from_numpy(spec.lookup_table()).to(self.device)  # [3, 256]
        self.weights_id = checkpoint_id(path)
        log.info(
            "vlm_family_loaded",
            family=self.name,
            model_type=settings.model_type,
            path=str(path),
            tile=spec.tile,
            tokens_per_tile=self.image_seq_len,
            lm_hidden=self.lm_hidden_size,
            device=str(self.device),
            dtype=str(dtype).removeprefix("torch."),
        )

    def describe(self) -> dict:
        return self.settings.describe()

    def pixel_values(self, rgb: np.ndarray) -> tuple[torch.Tensor, TilePlan]:
        """[H, W, 3] uint8 -> ([T, 3, tile, tile] normalized pixels on the device, plan)."""
        ok = isinstance(rgb, np.ndarray) and rgb.dtype == np.uint8 and rgb.ndim == 3
        if not ok or rgb.shape[2] != 3 or 0 in rgb.shape:
            shape = getattr(rgb, "shape", None)
            raise ImageError("invalid_image", f"expected [H, W, 3] uint8 pixels, got {shape}")
        tiles, plan = preprocess(rgb, self.spec)  # [T, t, t, 3] uint8
        idx = torch.from_numpy(tiles).to(self.device).permute(0, 3, 1, 2).long()  # [T, 3, t, t]
        channel = torch.arange(3, device=self.device).view(1, 3, 1, 1)
        return self._lut[channel, idx], plan  # [T, 3, t, t] float32

    @torch.inference_mode()
    def encode(self, rgb: np.ndarray) -> Idefics3Output:
        pixels, plan = self.pixel_values(rgb)  # [T, 3, t, t]
        n, _, t, _ = pixels.shape
        side = t // self.patch
        mask = torch.ones(n, side, side, dtype=torch.bool, device=self.device)
        hidden = self.tower(
            pixel_values=pixels.to(self.dtype), patch_attention_mask=mask
        ).last_hidden_state  # [T, P, D]
        merged = pixel_shuffle(hidden, self.scale)  # [T, P/s^2, D*s^2]
        embeds = self.projection(merged).reshape(-1, self.lm_hidden_size)  # [T*seq, lm_hidden]
        embeds = embeds.float()
        return Idefics3Output(
            embeds=embeds,
            saliency=embeds.norm(dim=-1),  # [T*seq]
            runs=[self.image_seq_len] * plan.tiles,
            grid=(plan.rows, plan.cols),
        )

    def layout(self, kept_per_run: list[int], out: FamilyOutput) -> ImageLayout:
        grid = getattr(out, "grid", None)
        if grid is None:
            if len(out.runs) != 1:
                raise ValueError("idefics3 layout needs the tile grid of an Idefics3Output")
            grid = (0, 0)
        rows, cols = grid
        if len(kept_per_run) != len(out.runs) or (rows * cols + 1 if rows else 1) != len(out.runs):
            raise ValueError(
                f"kept_per_run has {len(kept_per_run)} runs; the image has {len(out.runs)} "
                f"({rows} x {cols} tiles + global)"
            )
        for kept, total in zip(kept_per_run, out.runs, strict=True):
            if not 0 <= kept <= total:
                raise ValueError(f"a run keeps {kept} of {total} rows")
        pieces = expand_image(
            rows,
            cols,
            list(kept_per_run),
            fake=self.tokens["fake_image_token"],
            global_tag=self.tokens["global_image_token"],
        )
        return ImageLayout(placeholder=self.placeholder, pieces=pieces)
