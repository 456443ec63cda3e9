"""Decoded pixels -> normalized patch rows on the tower's device, in one fused step per image.

`PreprocessSpec` says what the tower expects: CLIP resizes the shorter side to the input size
and center-crops (bicubic); SigLIP squashes the whole image to a square (bilinear). The
geometry becomes a `ResizeCrop`, and `resize_normalize_patchify` (both in
`visiongate_kernels.resize_patchify`) turns the uint8 HWC image straight into [N, 3*P*P] rows:
the Triton kernel on CUDA, the torch reference on CPU.

`pil_preprocess` is the classic path (Pillow resize + crop, numpy normalize) kept as the
baseline and as a cross-check.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch
from PIL import Image

from visiongate_kernels.resize_patchify import ResizeCrop, resize_normalize_patchify

__all__ = (
    "CLIP_MEAN",
    "CLIP_STD",
    "PreprocessSpec",
    "pil_preprocess",
    "preprocess_batch",
    "resize_plan",
)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class PreprocessSpec(msgspec.Struct, frozen=True, kw_only=True):
    image_size: int  # square input side the tower takes
    patch_size: int
    resize: str = "shortest_edge_crop"  # or "squash"
    resample: str = "bicubic"  # or "bilinear"
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid


def resize_plan(h: int, w: int, spec: PreprocessSpec) -> tuple[int, int, int, int]:
    """(resized_h, resized_w, crop_top, crop_left) for an h x w image."""
    s = spec.image_size
    if spec.resize == "squash":
        return s, s, 0, 0
    if h <= w:
        rh, rw = s, max(s, int(s * w / h))
    else:
        rh, rw = max(s, int(s * h / w)), s
    return rh, rw, (rh - s) // 2, (rw - s) // 2


MAX_ASPECT = 4  # beyond this, the long side is cut to the centre before resizing


def center_window(img: torch.Tensor, spec: PreprocessSpec) -> torch.Tensor:
    """For a very elongated image, the centred part of the long side that the final square crop
    can see (plus the resampling filter's reach). Resizing all of a 1 x 100000 strip to a
    224-pixel short side would need gigabytes; this window keeps it to about a square."""
    h, w = int(img.shape[0]), int(img.shape[1])
    short, long = min(h, w), max(h, w)
    if spec.resize != "shortest_edge_crop" or long <= MAX_ASPECT * short:
        return img
    margin = 2 * max(1, -(-short // spec.image_size)) + 2  # filter support in source pixels
    keep = min(long, short + 2 * margin)
    start = (long - keep) // 2
    return img[:, start : start + keep] if w >= h else img[start : start + keep]


def preprocess_batch(
    images: list[torch.Tensor],  # each [H, W, 3] uint8 (CPU or on `device`)
    spec: PreprocessSpec,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """-> patch rows [B, N, 3*P*P] in `dtype` on `device`."""
    s, p = spec.image_size, spec.patch_size
    out = torch.empty(len(images), spec.num_patches, 3 * p * p, dtype=dtype, device=device)
    for i, img in enumerate(images):
        img = center_window(img, spec)
        h, w, _ = img.shape
        geom = ResizeCrop(*resize_plan(h, w, spec), s, s, spec.resample)  # type: ignore[arg-type]
        img = img.to(device, non_blocking=True)
        resize_normalize_patchify(img, geom, spec.mean, spec.std, p, out=out[i])
    return out


def pil_preprocess(arr: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    """Baseline: Pillow resize + crop, numpy normalize -> [3, S, S] float32 pixel values."""
    h, w, _ = arr.shape
    rh, rw, top, left = resize_plan(h, w, spec)
    resample = Image.BICUBIC if spec.resample == "bicubic" else Image.BILINEAR
    img = Image.fromarray(arr).resize((rw, rh), resample)
    s = spec.image_size
    img = img.crop((left, top, left + s, top + s))
    x = np.asarray(img, dtype=np.float32) / 255.0
    x = (x - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))
