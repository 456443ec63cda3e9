"""One scheduler step as one forward pass: many sequences' new positions packed into one row.

The scheduler hands `run_step` a list of `Slice`s, each a run of new positions of one
sequence (a prefill chunk, or the one token a decoding sequence feeds). Their input embeddings
are concatenated into a single `[1, T, H]` input with explicit rotary positions, so every
linear layer, norm and MLP of the model runs once for the whole batch. Attention is the only
per-sequence operation: the model's own decoder layers call the attention function
registered here (`visiongate`), which writes each slice's new keys/values into its sequence's
`SeqKV` buffer and attends over that sequence's own keys only (causal from the slice's offset).
No padding, no attention mask over the batch, and no copy of the cached keys per step.

`SeqKV` holds one sequence's keys and values as one contiguous tensor per layer,
`[2, Hkv, capacity, D]`, grown by doubling. On a CPU that is the layout attention reads
fastest; shared prefixes are copied into it once when the sequence is admitted (see
`gateway.engine.local.kv.prefix_cache`) rather than gathered from blocks on every step.

The model code is the checkpoint's own (transformers' decoder layers, rotary embedding, norms);
what changes is only where keys/values live and which keys each query sees.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ("ATTENTION_NAME", "SeqKV", "Slice", "StepBatch", "install_attention", "run_step")

ATTENTION_NAME = "visiongate"


class SeqKV:
    """Keys and values of one sequence, per layer `[2, Hkv, capacity, D]` (0: keys, 1: values)."""

    __slots__ = ("capacity", "device", "dtype", "head_dim", "kv_heads", "layers", "length")

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.capacity = max(capacity, 1)
        self.length = 0  # positions whose keys/values are written
        self.layers = [
            torch.empty(2, kv_heads, self.capacity, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]

    @property
    def nbytes(self) -> int:
        t = self.layers[0]
        return len(self.layers) * t.numel() * t.element_size()

    @staticmethod
    def bytes_per_position(
        num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return num_layers * 2 * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def reserve(self, length: int) -> None:
        """Make room for `length` positions (doubling), keeping what is written."""
        if length <= self.capacity:
            return
        cap = self.capacity
        while cap < length:
            cap *= 2
        for i, old in enumerate(self.layers):
            new = torch.empty(
                2, self.kv_heads, cap, self.head_dim, dtype=self.dtype, device=self.device
            )
            new[:, :, : self.length] = old[:, :, : self.length]
            self.layers[i] = new
        self.capacity = cap

    def load(self, layers: Sequence[torch.Tensor], start: int, n: int) -> None:
        """Write `n` positions from per-layer `[2, Hkv, >= n, D]` tensors at `start`."""
        self.reserve(start + n)
        for dst, src in zip(self.layers, layers, strict=True):
            dst[:, :, start : start + n] = src[:, :, :n].to(dst.device, dst.dtype)
        self.length = max(self.length, start + n)

    def view(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Positions [start, end) of one layer, `[2, Hkv, end - start, D]` (a view)."""
        return self.layers[layer][:, :, start:end]


@dataclass(slots=True)
class Slice:
    """New positions [start, start + length) of one sequence, fed in this step."""

    kv: SeqKV
    start: int  # positions already in `kv` (the slice's first position)
    length: int
    embeds: torch.Tensor  # [length, H]
    positions: torch.Tensor  # [length] or [3, length] rotary positions (int64)
    want_logits: bool  # the slice ends where the sequence's next token is sampled


class StepBatch:
    """What the decoder layers see as their cache for one step.

    `update` (called by each attention layer with that layer's new keys/values for all T packed
    positions) writes every slice's part into its sequence's buffer; the registered attention
    function then attends per slice. `offsets[i]` is slice i's first row in the packed input.
    """

    is_compileable = False

    def __init__(self, slices: Sequence[Slice]) -> None:
        self.slices = list(slices)
        self.offsets: list[int] = []
        total = 0
        for s in self.slices:
            self.offsets.append(total)
            total += s.length
        self.total = total

    # transformers calls this from every attention layer: key/value [1, Hkv, T, D]
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kw: Any):
        for s, off in zip(self.slices, self.offsets, strict=False):
            dst = s.kv.layers[layer_idx]
            dst[0, :, s.start : s.start + s.length] = key[0, :, off : off + s.length]
            dst[1, :, s.start : s.start + s.length] = value[0, :, off : off + s.length]
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:  # only asked when positions are absent
        return 0


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    vg_step: StepBatch | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Per-slice causal attention over each sequence's own buffer; returns [1, T, Hq, D]."""
    if vg_step is None:
        raise RuntimeError("the visiongate attention runs only inside a scheduler step")
    layer = module.layer_idx
    out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])  # [1, T, Hq, D]
    gqa = query.shape[1] != vg_step.slices[0].kv.kv_heads if vg_step.slices else False
    for s, off in zip(vg_step.slices, vg_step.offsets, strict=False):
        end = s.start + s.length
        kv = s.kv.layers[layer]
        k = kv[0, :, :end].unsqueeze(0)  # [1, Hkv, end, D]
        v = kv[1, :, :end].unsqueeze(0)
        q = query[:, :, off : off + s.length]  # [1, Hq, t, D]
        mask = None
        causal = False
        if sliding_window is not None and end > sliding_window:
            # a sliding-window layer: query i (position start + i) sees keys
            # start + i - window < k <= start + i, as transformers' sliding mask has it
            cols = torch.arange(end, device=q.device)
            rows = torch.arange(s.start, end, device=q.device)[:, None]
            mask = (cols[None, :] <= rows) & (cols[None, :] > rows - sliding_window)
        elif s.length > 1:
            if s.start == 0:
                causal = True
            else:  # query i sits at position start + i and sees keys 0..start + i
                cols = torch.arange(end, device=q.device)
                rows = torch.arange(s.start, end, device=q.device)
                mask = cols[None, :] <= rows[:, None]  # [t, end]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=gqa
        )  # [1, Hq, t, D]
        out[0, off : off + s.length] = o[0].transpose(0, 1)
    return out, None


_installed = False


def install_attention(model: Any) -> None:
    """Register the attention function and switch `model` (and its sub-configs) to it."""
    global _installed
    from transformers import AttentionInterface

    if not _installed:
        AttentionInterface.register(ATTENTION_NAME, _attention)
        try:
            from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

            # no mask is ever built for it: slices carry their own causality
            ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(ATTENTION_NAME, None)
        except ImportError:
            pass
        _installed = True
    configs = [getattr(model, "config", None)]
    configs += [getattr(c, "config", None) for c in model.modules() if hasattr(c, "config")]
    for cfg in configs:
        if cfg is None:
            continue
        for sub in (cfg, *(getattr(cfg, n) for n in ("text_config",) if hasattr(cfg, n))):
            if sub is not None and hasattr(sub, "_attn_implementation"):
                try:
                    sub._attn_implementation = ATTENTION_NAME
                except (AttributeError, ValueError):
                    sub._attn_implementation_internal = ATTENTION_NAME


def cache_param(decoder: Any) -> str:
    """transformers 5.x names the decoder's cache argument `cache`; 4.x `past_key_values`."""
    params = inspect.signature(decoder.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def run_step(
    decoder: Any,
    lm_head: Any,
    slices: Sequence[Slice],
    *,
    mrope: bool,
    cache_arg: str = "cache",
) -> torch.Tensor:
    """Run one packed forward; return next-token logits [n, vocab] for slices that want them."""
    step = StepBatch(slices)
    embeds = torch.cat([s.embeds for s in slices], dim=0).unsqueeze(0)  # [1, T, H]
    if mrope:
        pos = torch.cat([s.positions for s in slices], dim=1).unsqueeze(1)  # [3, 1, T]
    else:
        pos = torch.cat([s.positions for s in slices], dim=0).unsqueeze(0)  # [1, T]
    out = decoder(
        inputs_embeds=embeds, position_ids=pos, use_cache=True, vg_step=step, **{cache_arg: step}
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [1, T, H]
    rows = [
        off + s.length - 1 for s, off in zip(slices, step.offsets, strict=False) if s.want_logits
    ]
    for s in slices:
        s.kv.length = max(s.kv.length, s.start + s.length)
    if not rows:
        return hidden.new_empty(0, 0)
    picked = hidden[0, torch.tensor(rows, device=hidden.device)]  # [n, H]
    return lm_head(picked).float()  # [n, vocab]
