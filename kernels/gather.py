"""Top-k token selection and the gather of kept tokens.

`topk_sorted` picks, per image, the `k[b]` highest-scoring tokens and returns their indices in
ascending (spatial) order, padded with -1 up to max(k). The selection is one `torch.topk` over
the batch plus a sort: the same ops for every image and every token, no per-token branching.

`gather_tokens` then copies the kept rows: out[b, j] = x[b, idx[b, j]], zeros where idx is -1.
- `gather_tokens_ref`: torch reference (`torch.gather` on a clamped index, then a mask).
- `_gather_tokens_kernel`: Triton, one program per (image, kept token, block of channels).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from visiongate_kernels._triton import Impl, jit, use_triton

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ("gather_tokens", "gather_tokens_ref", "topk_sorted")


def topk_sorted(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """scores [B, N], k [B] int -> kept indices [B, max(k)] int64, ascending, -1 padded."""
    b, n = scores.shape
    kmax = int(k.max()) if b else 0
    top = torch.topk(scores, kmax, dim=1, sorted=True).indices  # [B, Kmax], best first
    rank = torch.arange(kmax, device=scores.device)[None, :]  # [1, Kmax]
    keep = rank < k.to(scores.device)[:, None]  # [B, Kmax]
    # push the unkept slots past every real index, sort, then mark them -1
    idx = torch.where(keep, top, torch.full_like(top, n)).sort(dim=1).values
    return torch.where(idx < n, idx, torch.full_like(idx, -1))


def gather_tokens_ref(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Torch reference. x [B, T, D], idx [B, K] (-1 = empty) -> [B, K, D]."""
    d = x.shape[-1]
    safe = idx.clamp(min=0)[..., None].expand(-1, -1, d)  # [B, K, D]
    out = torch.gather(x, 1, safe)
    return out * (idx >= 0)[..., None].to(out.dtype)


def _gather_tokens_kernel(
    x_ptr,  # [B, T, D]
    idx_ptr,  # [B, K] int64
    out_ptr,  # [B, K, D]
    T,
    K,
    D,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    src = tl.load(idx_ptr + b * K + j)
    live = src >= 0
    src = tl.maximum(src, 0)
    m = cols < D
    v = tl.load(x_ptr + (b.to(tl.int64) * T + src) * D + cols, mask=m, other=0.0)
    v = tl.where(live, v, tl.zeros_like(v))
    tl.store(out_ptr + (b.to(tl.int64) * K + j) * D + cols, v, mask=m)


def gather_tokens(x: torch.Tensor, idx: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """x [B, T, D], idx [B, K] int64 (-1 = empty slot) -> kept tokens [B, K, D]."""
    if x.dim() != 3 or idx.dim() != 2 or idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"expected x [B, T, D] and idx [B, K], got {tuple(x.shape)}, {tuple(idx.shape)}"
        )
    if not use_triton(x, impl):
        return gather_tokens_ref(x, idx)
    b, t, d = x.shape
    k = idx.shape[1]
    out = torch.empty(b, k, d, dtype=x.dtype, device=x.device)
    if b and k:
        block = min(1024, 1 << (d - 1).bit_length())
        kernel = jit(_gather_tokens_kernel, interpret=not x.is_cuda)
        kernel[(b, k, -(-d // block))](
            x.contiguous(), idx.to(torch.int64).contiguous(), out, t, k, d, BLOCK_D=block
        )
    return out
