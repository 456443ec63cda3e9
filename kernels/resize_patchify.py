"""Fused resize + normalize + patchify: uint8 HWC image -> [N, C*P*P] patch rows.

The resize is the separable antialiased filter Pillow uses (bicubic a=-0.5 or bilinear; the
filter widens by the downscale factor so a big photo is low-passed, not aliased), followed by
a crop (`ResizeCrop` says both).

- `resize_normalize_patchify_ref`: torch reference: `F.interpolate(antialias=True)` (the same
  filter), crop, normalize, reshape into patch rows. On CPU it resizes the uint8 image
  directly (torch's vectorized uint8 path, rounding to whole levels like Pillow);
  `exact=True` resizes in float instead.
- `_resize_normalize_patchify_kernel`: Triton, one program per block of output pixels. Each
  axis gets a table of `starts` and `weights` (`resize_taps`, crop folded in); each pixel walks
  its KY x KX taps, clamps to [0, 255], normalizes and writes straight into its patch row, so
  the resized image never exists in memory.

`resize_normalize_patchify` picks one by device (see `_triton.use_triton`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch
import torch.nn.functional as F

from visiongate_kernels._triton import Impl, jit, use_triton

if TYPE_CHECKING:
    import triton.language as tl

__all__ = (
    "Filter",
    "ResizeCrop",
    "resize_normalize_patchify",
    "resize_normalize_patchify_ref",
    "resize_taps",
)

Filter = Literal["bicubic", "bilinear"]
_SUPPORT = {"bicubic": 2.0, "bilinear": 1.0}


def _filter(x: torch.Tensor, kind: Filter) -> torch.Tensor:
    x = x.abs()
    if kind == "bilinear":
        return (1.0 - x).clamp(min=0.0)
    a = -0.5  # Pillow's bicubic
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return torch.where(x < 1.0, near, torch.where(x < 2.0, far, torch.zeros_like(x)))


def resize_taps(
    in_size: int, out_size: int, kind: Filter, crop_start: int = 0, crop_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Filter taps for resizing one axis from `in_size` to `out_size`, then cropping.

    Returns `starts` int32 [crop_len] and `weights` float32 [crop_len, K]: output pixel i is
    sum_k weights[i, k] * src[starts[i] + k], with weights past the image edge set to zero.
    Computed in float64 on the CPU so every device sees the same taps.
    """
    crop_len = out_size - crop_start if crop_len is None else crop_len
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = _SUPPORT[kind] * filterscale
    k = math.ceil(support) * 2 + 1
    out = torch.arange(crop_start, crop_start + crop_len, dtype=torch.float64)
    center = (out + 0.5) * scale  # [O]
    xmin = torch.floor(center - support + 0.5).clamp(min=0)  # [O]
    xmax = torch.floor(center + support + 0.5).clamp(max=in_size)  # [O]
    src = xmin[:, None] + torch.arange(k, dtype=torch.float64)  # [O, K]
    w = _filter((src - center[:, None] + 0.5) / filterscale, kind)
    w = torch.where(src < xmax[:, None], w, torch.zeros_like(w))
    w = w / w.sum(dim=1, keepdim=True)
    return xmin.to(torch.int32), w.to(torch.float32)


class ResizeCrop(NamedTuple):
    """Resize the whole image to resized_h x resized_w, then keep out_h x out_w from (top, left)."""

    resized_h: int
    resized_w: int
    top: int
    left: int
    out_h: int
    out_w: int
    kind: Filter = "bicubic"


def resize_normalize_patchify_ref(
    image: torch.Tensor,  # [H, W, C] uint8
    geom: ResizeCrop,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    patch: int,
    out: torch.Tensor,  # [N, C*P*P]
    exact: bool = False,
) -> torch.Tensor:
    """Torch reference: antialiased interpolate, crop, clamp, normalize, cut into patch rows."""
    c = image.shape[2]
    x = image.permute(2, 0, 1)[None]  # [1, C, H, W]
    if exact or not (image.device.type == "cpu" and geom.kind in ("bicubic", "bilinear")):
        x = x.float()
    else:
        x = x.contiguous(memory_format=torch.channels_last)  # the vectorized uint8 kernel
    x = F.interpolate(x, size=(geom.resized_h, geom.resized_w), mode=geom.kind, antialias=True)
    x = x[0, :, geom.top : geom.top + geom.out_h, geom.left : geom.left + geom.out_w]  # [C, OH, OW]
    x = x.float().clamp_(0.0, 255.0)
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).view(c, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=x.device).view(c, 1, 1)
    x = (x / 255.0 - m) / s
    gh, gw = geom.out_h // patch, geom.out_w // patch
    x = x.reshape(c, gh, patch, gw, patch).permute(1, 3, 0, 2, 4)  # [GH, GW, C, P, P]
    out.copy_(x.reshape(gh * gw, c * patch * patch))
    return out


def _resize_normalize_patchify_kernel(
    img_ptr,  # [H, W, 3] uint8
    sy_ptr,
    wy_ptr,  # [OH] int32, [OH, KY] f32
    sx_ptr,
    wx_ptr,  # [OW] int32, [OW, KX] f32
    out_ptr,  # [GH*GW, 3*P*P]
    H,
    W,
    OH,
    OW,
    KY,
    KX,
    scale0,
    scale1,
    scale2,  # 1 / (255 * std_c)
    shift0,
    shift1,
    shift2,  # mean_c / std_c
    P: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # flat output pixel index, row-major
    valid = offs < OH * OW
    oy = offs // OW
    ox = offs % OW
    y0 = tl.load(sy_ptr + oy, mask=valid, other=0)
    x0 = tl.load(sx_ptr + ox, mask=valid, other=0)
    acc0 = tl.full([BLOCK], 0.0, tl.float32)
    acc1 = tl.full([BLOCK], 0.0, tl.float32)
    acc2 = tl.full([BLOCK], 0.0, tl.float32)
    for ky in range(KY):
        wy = tl.load(wy_ptr + oy * KY + ky, mask=valid, other=0.0)
        sy = tl.minimum(y0 + ky, H - 1)  # past-the-edge taps carry zero weight
        for kx in range(KX):
            wgt = wy * tl.load(wx_ptr + ox * KX + kx, mask=valid, other=0.0)
            sx = tl.minimum(x0 + kx, W - 1)
            base = (sy.to(tl.int64) * W + sx) * 3
            acc0 += wgt * tl.load(img_ptr + base, mask=valid, other=0).to(tl.float32)
            acc1 += wgt * tl.load(img_ptr + base + 1, mask=valid, other=0).to(tl.float32)
            acc2 += wgt * tl.load(img_ptr + base + 2, mask=valid, other=0).to(tl.float32)
    v0 = tl.minimum(tl.maximum(acc0, 0.0), 255.0) * scale0 - shift0
    v1 = tl.minimum(tl.maximum(acc1, 0.0), 255.0) * scale1 - shift1
    v2 = tl.minimum(tl.maximum(acc2, 0.0), 255.0) * scale2 - shift2
    # patch row = which patch; column = c*P*P + (row within patch)*P + (col within patch)
    row = (oy // P) * (OW // P) + ox // P
    col = (oy % P) * P + ox % P
    dst = out_ptr + row.to(tl.int64) * (3 * P * P) + col
    ty = out_ptr.dtype.element_ty
    tl.store(dst, v0.to(ty), mask=valid)
    tl.store(dst + P * P, v1.to(ty), mask=valid)
    tl.store(dst + 2 * P * P, v2.to(ty), mask=valid)


def resize_normalize_patchify(
    image: torch.Tensor,  # [H, W, 3] uint8, on the target device
    geom: ResizeCrop,
    mean: tuple[float, float, float],
    std: tuple[float, float, float],
    patch: int,
    out: torch.Tensor | None = None,  # [N, 3*P*P], any float dtype, on image.device
    impl: Impl = "auto",
) -> torch.Tensor:
    """Resize (antialiased), crop, normalize and patchify in one step; returns `out` [N, 3*P*P]."""
    if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[2] != 3:
        raise ValueError(
            f"expected a [H, W, 3] uint8 image, got {tuple(image.shape)} {image.dtype}"
        )
    oh, ow = geom.out_h, geom.out_w
    if oh % patch or ow % patch:
        raise ValueError(f"output {oh}x{ow} is not a whole number of {patch}px patches")
    if geom.top + oh > geom.resized_h or geom.left + ow > geom.resized_w:
        raise ValueError(f"crop {geom} falls outside the resized image")
    n = (oh // patch) * (ow // patch)
    if out is None:
        out = torch.empty(n, 3 * patch * patch, dtype=torch.float32, device=image.device)
    if not use_triton(image, impl):
        return resize_normalize_patchify_ref(image, geom, mean, std, patch, out)

    h, w = image.shape[:2]
    dev = image.device
    sy, wy = (t.to(dev) for t in resize_taps(h, geom.resized_h, geom.kind, geom.top, oh))
    sx, wx = (t.to(dev) for t in resize_taps(w, geom.resized_w, geom.kind, geom.left, ow))
    kernel = jit(_resize_normalize_patchify_kernel, interpret=not image.is_cuda)
    block = 256
    grid = ((oh * ow + block - 1) // block,)
    kernel[grid](
        image.contiguous(),
        sy,
        wy,
        sx,
        wx,
        out,
        h,
        w,
        oh,
        ow,
        wy.shape[1],
        wx.shape[1],
        *(1.0 / (255.0 * s) for s in std),
        *(m / s for m, s in zip(mean, std, strict=False)),
        P=patch,
        BLOCK=block,
    )
    return out
