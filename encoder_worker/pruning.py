"""Semantic patch dropping: which patch tokens the language model gets to see.

Modes (`EncoderConfig.pruning`):
- `none`: every patch token.
- `random`: `keep_ratio` of them, chosen at random (seeded per image): a baseline.
- `topk`: the `keep_ratio` most salient.
- `dynamic`: the keep ratio follows how concentrated the saliency is: the fewest tokens holding
  `saliency_mass` of it, clamped to [min_keep_ratio, max_keep_ratio]. A photo whose attention
  sits on a few patches keeps few; a busy scene keeps more.
- `dynamic+merge`: as `dynamic`, but the last `merge_tokens` of the budget become contextual
  tokens: a few dropped tokens (evenly spaced) serve as anchors, every other dropped token joins
  the anchor whose key it is most similar to, and each group is averaged (VisionZip's
  dominant + contextual split), so what was dropped is summarized rather than lost.

Selection is one batched top-k (`topk_sorted`) and one gather (`gather_tokens`), both in
`visiongate_kernels.gather`: kept tokens come out in their original spatial order, with their
patch indices. Contextual tokens follow the dominant ones and carry their anchor's patch index.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from visiongate_kernels.gather import gather_tokens, topk_sorted

__all__ = ("PrunedImage", "dynamic_keep_ratio", "keep_counts", "merge_dropped", "prune")


class PrunedImage(NamedTuple):
    tokens: torch.Tensor  # [K, D] dominant tokens (spatial order) then contextual ones
    positions: torch.Tensor  # [K] int64 patch index (contextual: the anchor's)
    n_contextual: int


def dynamic_keep_ratio(
    saliency: torch.Tensor, mass: float, min_ratio: float, max_ratio: float
) -> torch.Tensor:
    """saliency [B, N] -> keep ratio [B]: the share of tokens holding `mass` of the saliency."""
    n = saliency.shape[1]
    p = saliency.float().clamp(min=0)
    p = p / p.sum(dim=1, keepdim=True).clamp(min=1e-12)
    cum = p.sort(dim=1, descending=True).values.cumsum(dim=1)  # [B, N]
    needed = (cum < mass).sum(dim=1) + 1  # [B]
    return (needed.float() / n).clamp(min_ratio, max_ratio)


def keep_counts(saliency: torch.Tensor, mode: str, cfg) -> torch.Tensor:
    """Tokens each image keeps (contextual ones included) [B] int64."""
    b, n = saliency.shape
    if mode == "none":
        ratio = torch.ones(b)
    elif mode in ("random", "topk"):
        ratio = torch.full((b,), cfg.keep_ratio)
    else:
        ratio = dynamic_keep_ratio(
            saliency, cfg.saliency_mass, cfg.min_keep_ratio, cfg.max_keep_ratio
        )
    return (ratio.cpu() * n).round().long().clamp(1, n)


def merge_dropped(
    features: torch.Tensor,  # [N, D]
    keys: torch.Tensor,  # [N, Dk]
    dropped: torch.Tensor,  # [R] int64 ascending patch indices not kept
    n_contextual: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (contextual tokens [C, D], anchor patch indices [C]); C = min(n_contextual, R)."""
    r = dropped.numel()
    c = min(n_contextual, r)
    if c == 0:
        return features.new_zeros(0, features.shape[1]), dropped.new_zeros(0)
    local = torch.arange(c, device=dropped.device) * r // c  # evenly spaced anchors [C]
    is_anchor = torch.zeros(r, dtype=torch.bool, device=dropped.device)
    is_anchor[local] = True
    rest = (~is_anchor).nonzero().squeeze(1)  # [R-C]
    k = F.normalize(keys[dropped].float(), dim=-1)  # [R, Dk]
    assign = (k[rest] @ k[local].T).argmax(dim=1)  # [R-C] -> anchor slot
    x = features[dropped].float()  # [R, D]
    sums = x[local].clone().index_add_(0, assign, x[rest])  # [C, D]
    counts = torch.ones(c, device=x.device).index_add_(
        0, assign, torch.ones_like(assign, dtype=x.dtype)
    )
    return (sums / counts[:, None]).to(features.dtype), dropped[local]


def prune(
    features: torch.Tensor,  # [B, N, D]
    saliency: torch.Tensor,  # [B, N]
    keys: torch.Tensor,  # [B, N, Dk]
    cfg,
    seeds: list[int],
) -> list[PrunedImage]:
    """Apply `cfg.pruning` to a batch; `seeds` (one per image) drive the `random` mode."""
    b, n, _ = features.shape
    mode = cfg.pruning
    counts = keep_counts(saliency, mode, cfg)  # [B]
    n_ctx = torch.zeros(b, dtype=torch.long)
    if mode == "dynamic+merge":
        n_ctx = torch.minimum(torch.full((b,), cfg.merge_tokens), counts - 1).clamp(min=0)
        n_ctx = torch.minimum(n_ctx, n - (counts - n_ctx))  # cannot merge more than was dropped
    dominant = counts - n_ctx  # [B]
    if mode == "none":
        scores = torch.arange(n, 0, -1, dtype=torch.float32).expand(b, n)
    elif mode == "random":
        scores = torch.stack(
            [torch.rand(n, generator=torch.Generator().manual_seed(s)) for s in seeds]
        )
    else:
        scores = saliency.float().cpu()
    idx = topk_sorted(scores.to(features.device), dominant.to(features.device))  # [B, Kmax]
    kept = gather_tokens(features, idx)  # [B, Kmax, D]
    out: list[PrunedImage] = []
    for i in range(b):
        k = int(dominant[i])
        tokens, positions = kept[i, :k], idx[i, :k]
        c = int(n_ctx[i])
        if c:
            mask = torch.ones(n, dtype=torch.bool, device=features.device)
            mask[positions] = False
            dropped = mask.nonzero().squeeze(1)
            ctx, anchors = merge_dropped(features[i], keys[i], dropped, c)
            tokens = torch.cat([tokens, ctx])
            positions = torch.cat([positions, anchors])
            c = ctx.shape[0]
        out.append(PrunedImage(tokens, positions, c))
    return out
