"""INT4 visual tokens: symmetric group-wise quantization, two values per byte.

Each row of `x` [N, D] is cut into groups of `group` values (the last one zero-padded). A group
stores one fp16 scale and `group / 2` bytes: value q in [-8, 7] is kept as the nibble q + 8,
element 2j in the low nibble of byte j and element 2j+1 in the high one.

The scale is picked per group, not just absmax / 7: a handful of clipping ratios are tried
(`CLIP_RATIOS`) and the one with the least squared error wins. On Gaussian-like tokens this
lifts the cosine to the original noticeably over plain absmax at the same size.

- `quantize_int4_ref` / `dequantize_int4_ref`: torch references.
- `_quantize_int4_kernel` / `_dequantize_int4_kernel`: Triton, one program per (row, group).
`quantize_int4` / `dequantize_int4` dispatch by device (see `_triton.use_triton`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from visiongate_kernels._triton import Impl, jit, use_triton

if TYPE_CHECKING:
    import triton.language as tl

__all__ = (
    "CLIP_RATIOS",
    "dequantize_int4",
    "dequantize_int4_ref",
    "packed_shapes",
    "quantize_int4",
    "quantize_int4_ref",
)

# candidate scales are ratio * absmax / 7; 1.0 first so ties keep plain absmax
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
_QMIN, _QMAX = -8, 7


def packed_shapes(n: int, hidden: int, group: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of (packed uint8, scales fp16) for `n` tokens of width `hidden`."""
    groups = -(-hidden // group)
    return (n, groups * group // 2), (n, groups)


def _check(x: torch.Tensor, group: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"expected [N, D] tokens, got {tuple(x.shape)}")
    if group < 2 or group & (group - 1):
        raise ValueError(f"group size must be a power of two >= 2, got {group}")


def quantize_int4_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference. x [N, D] float -> (packed [N, G*group/2] uint8, scales [N, G] fp16)."""
    _check(x, group)
    n, d = x.shape
    (_, nbytes), (_, groups) = packed_shapes(n, d, group)
    xg = torch.nn.functional.pad(x.float(), (0, groups * group - d)).view(n, groups, group)
    amax = xg.abs().amax(dim=-1)  # [N, G]
    best_err = torch.full_like(amax, float("inf"))
    best_scale = torch.zeros_like(amax)
    for ratio in CLIP_RATIOS:
        scale = (amax * (ratio / 7.0)).half().float()  # the scale as it will be stored
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.floor(xg * inv[..., None] + 0.5).clamp_(_QMIN, _QMAX)
        err = (q * scale[..., None] - xg).square().sum(dim=-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
    inv = torch.where(best_scale > 0, 1.0 / best_scale, torch.zeros_like(best_scale))
    q = torch.floor(xg * inv[..., None] + 0.5).clamp_(_QMIN, _QMAX).to(torch.int32) + 8
    q = q.view(n, nbytes, 2)  # [N, B, 2]: (low, high) nibble of each byte
    packed = (q[..., 0] | (q[..., 1] << 4)).to(torch.uint8)
    return packed, best_scale.half()


def dequantize_int4_ref(
    packed: torch.Tensor, scales: torch.Tensor, hidden: int, group: int
) -> torch.Tensor:
    """Torch reference. (packed [N, B] uint8, scales [N, G] fp16) -> [N, hidden] float32."""
    n, groups = scales.shape
    b = packed.to(torch.int32)
    q = torch.stack((b & 15, b >> 4), dim=-1).view(n, groups, group) - 8  # [N, G, group]
    x = q.float() * scales.float()[..., None]
    return x.view(n, groups * group)[:, :hidden]


def _quantize_int4_kernel(
    x_ptr,  # [N, D] float
    packed_ptr,  # [N, G*HALF] uint8
    scales_ptr,  # [N, G] fp16
    D,
    G,
    HALF: tl.constexpr,  # group / 2
    RATIOS: tl.constexpr,  # len(CLIP_RATIOS)
    RATIO_STEP: tl.constexpr,  # CLIP_RATIOS[i] = 1 - i * RATIO_STEP
):
    row = tl.program_id(0)
    g = tl.program_id(1)
    j = tl.arange(0, HALF)
    col = g * 2 * HALF + 2 * j  # even element of each byte
    base = x_ptr + row.to(tl.int64) * D
    lo = tl.load(base + col, mask=col < D, other=0.0).to(tl.float32)
    hi = tl.load(base + col + 1, mask=col + 1 < D, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(lo), axis=0), tl.max(tl.abs(hi), axis=0))
    best_err = float("inf")
    best_scale = 0.0
    for i in tl.static_range(RATIOS):
        scale = (amax * ((1.0 - i * RATIO_STEP) / 7.0)).to(tl.float16).to(tl.float32)
        inv = tl.where(scale > 0, 1.0 / tl.maximum(scale, 1e-30), 0.0)
        qlo = tl.minimum(tl.maximum(tl.floor(lo * inv + 0.5), -8.0), 7.0)
        qhi = tl.minimum(tl.maximum(tl.floor(hi * inv + 0.5), -8.0), 7.0)
        elo = qlo * scale - lo
        ehi = qhi * scale - hi
        err = tl.sum(elo * elo + ehi * ehi, axis=0)
        better = err < best_err
        best_err = tl.where(better, err, best_err)
        best_scale = tl.where(better, scale, best_scale)
    inv = tl.where(best_scale > 0, 1.0 / tl.maximum(best_scale, 1e-30), 0.0)
    qlo = tl.minimum(tl.maximum(tl.floor(lo * inv + 0.5), -8.0), 7.0).to(tl.int32) + 8
    qhi = tl.minimum(tl.maximum(tl.floor(hi * inv + 0.5), -8.0), 7.0).to(tl.int32) + 8
    byte = (qlo | (qhi << 4)).to(tl.uint8)
    tl.store(packed_ptr + row.to(tl.int64) * G * HALF + g * HALF + j, byte)
    tl.store(scales_ptr + row.to(tl.int64) * G + g, best_scale.to(tl.float16))


def _dequantize_int4_kernel(
    packed_ptr,  # [N, G*HALF] uint8
    scales_ptr,  # [N, G] fp16
    out_ptr,  # [N, D] float32
    D,
    G,
    HALF: tl.constexpr,
):
    row = tl.program_id(0)
    g = tl.program_id(1)
    j = tl.arange(0, HALF)
    byte = tl.load(packed_ptr + row.to(tl.int64) * G * HALF + g * HALF + j).to(tl.int32)
    scale = tl.load(scales_ptr + row.to(tl.int64) * G + g).to(tl.float32)
    lo = ((byte & 15) - 8).to(tl.float32) * scale
    hi = ((byte >> 4) - 8).to(tl.float32) * scale
    col = g * 2 * HALF + 2 * j
    base = out_ptr + row.to(tl.int64) * D
    tl.store(base + col, lo, mask=col < D)
    tl.store(base + col + 1, hi, mask=col + 1 < D)


_RATIO_STEP = 0.05
assert tuple(round(1.0 - i * _RATIO_STEP, 10) for i in range(len(CLIP_RATIOS))) == CLIP_RATIOS


def quantize_int4(
    x: torch.Tensor, group: int = 64, impl: Impl = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] -> (packed [N, G*group/2] uint8, scales [N, G] fp16), on x's device."""
    _check(x, group)
    if not use_triton(x, impl):
        return quantize_int4_ref(x, group)
    n, d = x.shape
    (_, nbytes), (_, groups) = packed_shapes(n, d, group)
    packed = torch.empty(n, nbytes, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n, groups, dtype=torch.float16, device=x.device)
    if n:
        kernel = jit(_quantize_int4_kernel, interpret=not x.is_cuda)
        kernel[(n, groups)](
            x.contiguous(),
            packed,
            scales,
            d,
            groups,
            HALF=group // 2,
            RATIOS=len(CLIP_RATIOS),
            RATIO_STEP=_RATIO_STEP,
        )
    return packed, scales


def dequantize_int4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    hidden: int,
    group: int = 64,
    impl: Impl = "auto",
) -> torch.Tensor:
    """(packed, scales) -> [N, hidden] float32, on packed's device."""
    n, nbytes = packed.shape
    if scales.shape != (n, nbytes * 2 // group) or hidden > nbytes * 2:
        raise ValueError(
            f"packed {tuple(packed.shape)} / scales {tuple(scales.shape)} do not fit "
            f"hidden={hidden} group={group}"
        )
    if not use_triton(packed, impl):
        return dequantize_int4_ref(packed, scales, hidden, group)
    out = torch.empty(n, hidden, dtype=torch.float32, device=packed.device)
    if n:
        kernel = jit(_dequantize_int4_kernel, interpret=not packed.is_cuda)
        kernel[(n, scales.shape[1])](
            packed.contiguous(), scales.contiguous(), out, hidden, scales.shape[1], HALF=group // 2
        )
    return out
