"""Qwen2.5-VL on the encoder side: pixels -> the checkpoint's own merged visual tokens.

Contract (see `encoder_worker.families.family`):

    family = Family(checkpoint_dir, device, dtype)
    out = family.encode(rgb)            # rgb [H, W, 3] uint8
    out.embeds    [N, out_hidden]       == model.get_image_features(pixel_values, grid_thw) rows
    out.saliency  [N]                   L2 norm of each merged row (see below)
    out.runs      [N]                   one run: the image is a single grid, no tiles
    out.mrope     [3, N] int64          (t, h, w) of each row relative to the image's start
    out.mrope_advance                   max(llm_grid_h, llm_grid_w): where the text resumes

Preprocessing is the checkpoint's image processor (`Qwen2VLImageProcessor`, slow PIL path),
reimplemented on numpy with the settings read from the checkpoint: `smart_resize` to multiples
of patch_size * merge_size with the pixel count inside [min_pixels, max_pixels] (aspect ratio
kept as far as that allows), one PIL resize with the processor's filter, rescale in float64
then float32, per-channel normalize, then patchify: every patch row is (C, T, P, P) with the
single frame repeated temporal_patch_size times, rows grouped merge_size x merge_size so each
group of merge_size**2 consecutive rows becomes one merged token. Bit-identical to the
processor's `pixel_values`. An image more elongated than 200:1 (which the processor refuses)
raises `ImageError("invalid_image")`. The decoder must not pre-reduce images
(`min_decode_side = 0`): the grid depends on the original size.

The tower is transformers' `Qwen2_5_VisionTransformerPretrainedModel` built from the
checkpoint's vision_config (windowed attention, full-attention blocks, 2-D rotary, patch
merger); its weights are read by key (`visual.*` as transformers writes them, or
`model.visual.*`) from the checkpoint's safetensors files (`encoder_worker.checkpoint`, with
`safe_open`); the language model is never built and its tensors are never read. The weights
id is `checkpoint_id` (from the files alone, as the gateway computes it too).

Saliency: the L2 norm of each merged row (the merger's output, i.e. the token the language
model receives). The tower's windowed attention has no CLS token to read attention from, and
rows with a large norm dominate the attention logits they enter, so the norm is a cheap,
model-agnostic proxy for how much a token can move the language model.

M-RoPE: Qwen2.5-VL's `get_rope_index` gives the k-th image token (row-major over the merged
grid llm_grid_h x llm_grid_w) the position start + (0, k // llm_grid_w, k % llm_grid_w) and
moves the text position past the image by max(llm_grid_h, llm_grid_w). `mrope` holds those
offsets per row, so dropped rows leave the kept ones at their original positions.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import structlog
import torch
from PIL import Image

from encoder_worker.checkpoint import checkpoint_id, read_tensors, safetensors_index
from encoder_worker.families.family import FamilyOutput, UnsupportedCheckpoint
from encoder_worker.types import ImageError, ImageLayout

__all__ = (
    "PLACEHOLDER",
    "Family",
    "describe_checkpoint",
    "grid_mrope",
    "max_image_tokens",
    "smart_resize",
)

log = structlog.get_logger("encoder_worker.families.qwen2_5_vl")

PLACEHOLDER = "<|image_pad|>"
# Prefixes of the vision tower's weights: transformers (4.x and 5.x) writes `visual.*`; the
# in-memory module path of transformers 5 is `model.visual.*`, which some exports keep.
_VISION_PREFIXES = ("visual.", "model.visual.")
_MAX_ASPECT = 200  # the processor refuses images more elongated than this


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The processor's target size: multiples of `factor`, pixel count in [min, max] pixels."""
    if max(height, width) / min(height, width) > _MAX_ASPECT:
        raise ImageError(
            "invalid_image",
            f"image aspect ratio {max(height, width) / min(height, width):.0f}:1 is over the "
            f"{_MAX_ASPECT}:1 this model accepts",
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def grid_mrope(llm_grid_h: int, llm_grid_w: int) -> torch.Tensor:
    """[3, llm_grid_h * llm_grid_w] int64 (t, h, w) of each merged row of one image, row-major."""
    k = torch.arange(llm_grid_h * llm_grid_w, dtype=torch.int64)
    return torch.stack([torch.zeros_like(k), k // llm_grid_w, k % llm_grid_w])


class _Preprocess:
    """The checkpoint's Qwen2VLImageProcessor settings and their numpy application."""

    def __init__(self, checkpoint_dir: Path) -> None:
        from transformers import Qwen2VLImageProcessorPil

        try:
            proc = Qwen2VLImageProcessorPil.from_pretrained(checkpoint_dir, local_files_only=True)
        except (OSError, ValueError, TypeError) as exc:
            raise UnsupportedCheckpoint(
                f"{checkpoint_dir}: no readable Qwen2-VL image processor config ({exc})"
            ) from None
        size = proc.size
        self.min_pixels = int(size.shortest_edge)
        self.max_pixels = int(size.longest_edge)
        self.patch = int(proc.patch_size)
        self.merge = int(proc.merge_size)
        self.temporal = int(proc.temporal_patch_size)
        self.resample = int(proc.resample)
        self.rescale = float(proc.rescale_factor) if proc.do_rescale else None
        self.mean = np.asarray(proc.image_mean, dtype=np.float32) if proc.do_normalize else None
        self.std = np.asarray(proc.image_std, dtype=np.float32) if proc.do_normalize else None
        if not proc.do_resize:
            raise UnsupportedCheckpoint(f"{checkpoint_dir}: image processor with do_resize=False")

    def describe(self) -> dict:
        return {
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "patch_size": self.patch,
            "merge_size": self.merge,
            "temporal_patch_size": self.temporal,
            "resample": self.resample,
            "rescale_factor": self.rescale,
            "image_mean": None if self.mean is None else self.mean.tolist(),
            "image_std": None if self.std is None else self.std.tolist(),
        }

    def __call__(self, rgb: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """[H, W, 3] uint8 -> patch rows [gh * gw, 3 * T * P * P] float32 and (1, gh, gw)."""
        if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
            raise ValueError(f"expected [H, W, 3] uint8 RGB, got {rgb.shape} {rgb.dtype}")
        height, width = rgb.shape[:2]
        rh, rw = smart_resize(
            height, width, self.patch * self.merge, self.min_pixels, self.max_pixels
        )
        img = np.asarray(Image.fromarray(rgb).resize((rw, rh), resample=self.resample))
        x = img.astype(np.float64) * self.rescale if self.rescale is not None else img
        x = x.astype(np.float32)  # [H, W, C]
        if self.mean is not None:
            x = (x - self.mean) / self.std
        p, m, t = self.patch, self.merge, self.temporal
        gh, gw = rh // p, rw // p
        x = x.transpose(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p)
        x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        rows = np.ascontiguousarray(x).reshape(gh * gw, 3 * t * p * p)
        return rows, (1, gh, gw)


def _load_config(path: Path):
    from transformers import Qwen2_5_VLConfig

    try:
        config = Qwen2_5_VLConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise UnsupportedCheckpoint(f"{path}: not a readable Qwen2.5-VL config ({exc})") from None
    if config.model_type != "qwen2_5_vl":
        raise UnsupportedCheckpoint(f"{path}: model_type {config.model_type!r} is not qwen2_5_vl")
    return config


def describe_checkpoint(path: str | Path) -> dict:
    """What shapes the tokens besides the weights, from the checkpoint's files alone."""
    path = Path(path)
    vcfg = _load_config(path).vision_config
    return {
        "family": "qwen2_5_vl",
        "image_processor": _Preprocess(path).describe(),
        "window_size": int(vcfg.window_size),
        "fullatt_block_indexes": [int(i) for i in vcfg.fullatt_block_indexes],
        "spatial_merge_size": int(vcfg.spatial_merge_size),
        "saliency": "l2_norm(merged row)",
        "placeholder": PLACEHOLDER,
    }


def max_image_tokens(path: Path, *, max_pixels: int = 0) -> int:
    """Each merged row covers (patch * merge)^2 = f^2 pixels, and `smart_resize` keeps an image
    within the processor's `max_pixels` (P) but for one case: a side it scales below f is
    clamped up to f, so an image as elongated as the processor takes (`_MAX_ASPECT`: a) keeps
    its long side at sqrt(P * a) and becomes floor(sqrt(P * a) / f) rows of one. Scaled up
    toward `min_pixels` (m, in rows), each side rounds up: at most m + sqrt(a m) + sqrt(m / a)
    + 1 rows. The bound is the largest of the three."""
    pre = _Preprocess(path)
    factor = pre.patch * pre.merge
    within = pre.max_pixels // factor**2
    clamped = math.floor(math.sqrt(pre.max_pixels * _MAX_ASPECT) / factor)
    least = pre.min_pixels / factor**2
    scaled_up = math.ceil(
        least + math.sqrt(_MAX_ASPECT * least) + math.sqrt(least / _MAX_ASPECT) + 1
    )
    return max(within, clamped, scaled_up)


def _read_vision_weights(path: Path) -> dict[str, torch.Tensor]:
    """Vision tower + merger tensors by module-relative name, read by key (no pickle)."""
    try:
        index = safetensors_index(path)
    except ValueError as exc:
        raise UnsupportedCheckpoint(str(exc)) from None
    for prefix in _VISION_PREFIXES:
        keys = [k for k in index if k.startswith(prefix) and not k.endswith("inv_freq")]
        if keys:
            tensors = read_tensors(path, keys)
            return {k[len(prefix) :]: v for k, v in tensors.items()}
    raise UnsupportedCheckpoint(
        f"{path}: no vision tower weights ({' or '.join(p + '*' for p in _VISION_PREFIXES)})"
    )


class Family:
    """Qwen2.5-VL's vision tower + patch merger with its own preprocessing and M-RoPE offsets."""

    name = "qwen2_5_vl"
    placeholder = PLACEHOLDER

    min_decode_side = 0  # the grid depends on the original size: no reduction at decode

    def __init__(self, checkpoint_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        from transformers.initialization import no_init_weights
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        started = time.perf_counter()
        self.path = Path(checkpoint_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        vcfg = _load_config(self.path).vision_config
        self.preprocess = _Preprocess(self.path)
        pre = self.preprocess
        if (pre.patch, pre.merge, pre.temporal) != (
            vcfg.patch_size,
            vcfg.spatial_merge_size,
            vcfg.temporal_patch_size,
        ):
            raise UnsupportedCheckpoint(
                f"{self.path}: image processor (patch {pre.patch}, merge {pre.merge}, temporal "
                f"{pre.temporal}) does not match vision_config ({vcfg.patch_size}, "
                f"{vcfg.spatial_merge_size}, {vcfg.temporal_patch_size})"
            )
        self.merge = pre.merge
        self.lm_hidden_size = int(vcfg.out_hidden_size)
        self._describe = describe_checkpoint(self.path)
        self.weights_id = checkpoint_id(self.path)

        state = _read_vision_weights(self.path)
        # built straight on the device without random init: every parameter is loaded below
        with torch.device(self.device), no_init_weights():
            visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(vcfg, dtype=dtype)
        missing, unexpected = visual.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise UnsupportedCheckpoint(
                f"{self.path}: vision weights do not match vision_config "
                f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
            )
        self.visual = visual.eval().requires_grad_(False)
        log.info(
            "family_loaded",
            family=self.name,
            path=str(self.path),
            tensors=len(state),
            device=str(self.device),
            dtype=str(dtype).removeprefix("torch."),
            seconds=round(time.perf_counter() - started, 3),
        )

    def describe(self) -> dict:
        return dict(self._describe)

    @torch.inference_mode()
    def encode_batch(self, images: list[np.ndarray]) -> list[FamilyOutput]:
        """Several images in one tower call (attention never crosses images)."""
        if not images:
            return []
        prepared = [self.preprocess(rgb) for rgb in images]
        rows = np.concatenate([r for r, _ in prepared])  # [sum(gh*gw), 3*T*P*P]
        grid = torch.tensor([g for _, g in prepared], dtype=torch.int64, device=self.device)
        pixels = torch.from_numpy(rows).to(self.device, self.dtype)
        merged = self.visual(pixels, grid_thw=grid).pooler_output  # [sum(N), lm_hidden]
        merged = merged.float()
        outs: list[FamilyOutput] = []
        start = 0
        for _, (_, gh, gw) in prepared:
            llm_h, llm_w = gh // self.merge, gw // self.merge
            n = llm_h * llm_w
            embeds = merged[start : start + n].cpu()  # [N, lm_hidden]
            start += n
            outs.append(
                FamilyOutput(
                    embeds=embeds,
                    saliency=torch.linalg.vector_norm(embeds, dim=-1),  # [N]
                    runs=[n],
                    mrope=grid_mrope(llm_h, llm_w),  # [3, N]
                    mrope_advance=max(llm_h, llm_w),
                )
            )
        return outs

    def encode(self, rgb: np.ndarray) -> FamilyOutput:
        return self.encode_batch([rgb])[0]

    def layout(self, kept_per_run: list[int], out: FamilyOutput) -> ImageLayout:
        """One `<|image_pad|>` per kept row, with those rows' M-RoPE offsets.

        The offsets come from `out.mrope` when it holds exactly the kept rows' columns (an
        output already pruned to them, or nothing dropped). When rows were dropped from the
        `out` given, it cannot say which; `mrope` is then left empty for the caller to fill
        from the kept rows' indices (`out.mrope[:, kept]`), and `mrope_advance` is set."""
        if len(kept_per_run) != 1:
            raise ValueError(f"a Qwen2.5-VL image is one run, got {len(kept_per_run)} runs")
        kept = int(kept_per_run[0])
        if out.mrope is None:
            raise ValueError("a Qwen2.5-VL output carries M-RoPE offsets; this one has none")
        total = int(out.mrope.shape[1])
        if not 0 < kept <= total:
            raise ValueError(f"kept rows {kept} not in 1..{total}")
        flat: tuple[int, ...] = ()
        if kept == total:
            flat = tuple(out.mrope.to(torch.int64).t().reshape(-1).tolist())  # [t0, h0, w0, ...]
        return ImageLayout(
            placeholder=PLACEHOLDER,
            pieces=(kept,),
            mrope=flat,
            mrope_advance=int(out.mrope_advance),
            mrope_merge=self.merge,
        )
