"""A Llama decoder step in a few fused ops per layer: the fast path of the non-exact precisions.

`run_step` (`gateway.engine.local.batch`) runs the checkpoint's own transformers modules, which
is what the exact mode needs (float32, token-identical to transformers). On a CPU a small
model's decode step is then mostly not arithmetic: a 30-layer, 135M-parameter model spends more
time in the modules' Python (seven linear calls, a dozen small tensor ops, keyword plumbing and
a cache callback per layer) than in reading its weights. `FusedDecoder` runs the same
computation over the same packed slices with the weights rearranged once at load:

- q, k and v are one matrix (one linear call), gate and up are one matrix, so a layer makes
  four linear calls instead of seven;
- rotary embedding of q and k together (one view), RMSNorm as torch's fused `rms_norm`;
- each slice's new keys and values go into its `SeqKV` buffer with one copy;
- a decoding slice (one query) attends with its query heads grouped under their key/value
  head (`[1, Hkv, groups, D]` against `[1, Hkv, L, D]`), so no key or value is repeated;
- `int8`: every linear layer, the output head included, holds int8 weights with one scale per
  output channel, multiplied with bfloat16 activations (`torch._weight_int8pack_mm`): a
  quarter of float32's bytes to read per token. Only the weights are quantized: quantizing the
  activations too (fbgemm's dynamic quantization, one scale per call) was measured to raise the
  default model's perplexity 1.6x (`bench.precision`), weights alone by under 1%;
  `float16` on an x86 CPU: every matrix stored in float16, packed once for fbgemm's float16
  GEMM, which widens the weights to float32 inside its kernel while it multiplies, with float32
  activations and KV: half of float32's bytes to read per token, float32 arithmetic and no
  conversion of the activations (measured on a 2-core AVX2 CPU, one thread, the default model:
  a decode step's products take 0.46x float32's time with one sequence and 0.43x with eight,
  where `_weight_int8pack_mm` takes 0.8x and 0.9x and bfloat16's `F.linear` 1.5x and 3.4x);
  `bfloat16`, or `float16` without fbgemm: the fused matrices in that dtype. For those a step of
  `WIDE_ROWS` rows or more (prefill) multiplies in float32 on a CPU, from the same weights
  widened for the call: there the arithmetic, not the memory, bounds the step, and CPUs without
  bfloat16 instructions compute bfloat16 products slower than float32 ones.

Where the CPU decode kernels build (`visiongate_kernels.cpu_decode`, float32 activations on a
CPU): a step in which every slice decodes one position attends through their C++ attention (the
KV writes and the attention of all slices in one call a layer), and with float16 weights the
whole step runs there (`decode_layers`: every layer in one call, the same products through
fbgemm, plain loops for the norms, rotary, SiLU and residuals); the float16 matrices are packed
once, by the kernels' `Fp16Linear`, for both paths. Prefill steps stay in Python.

It takes Llama-architecture language models (`supported` says why another is refused, and the
engine then runs `run_step`), which is what the embedded default is. The results match
`run_step` in the same precision to within rounding (tests compare the two), not bit for bit,
which is why the exact mode never uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from gateway.engine.local.batch import Slice

__all__ = ("FUSED_PRECISIONS", "FusedDecoder", "supported")

# the precisions the engine runs through the fused step (float32 stays on the exact path;
# the fused step takes it too, which is how tests compare the two paths)
FUSED_PRECISIONS = ("bfloat16", "float16", "int8")
# from this many rows a step on the CPU multiplies in float32 (see `_Linear.__call__`)
WIDE_ROWS = 32
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,  # float32 where fbgemm packs the float16 weights (see below)
    "int8": torch.bfloat16,  # int8 weights, bfloat16 activations
}


def fp16_gemm_available() -> bool:
    """Whether this torch build has fbgemm's float16-weight GEMM (x86 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def activation_dtype(precision: str) -> torch.dtype:
    """The dtype of the fused step's activations and KV for `precision` on a CPU."""
    if precision == "float16" and fp16_gemm_available():
        return torch.float32  # float16 weights inside fbgemm's kernel, float32 arithmetic
    return _DTYPES[precision]


def supported(config: Any) -> str | None:
    """None when `config` (a text config) is a Llama the fused step computes exactly as
    transformers' modules do; else why not."""
    if getattr(config, "model_type", None) != "llama":
        return f"model_type {getattr(config, 'model_type', None)!r} is not llama"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "biased projections"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    return None


class _Linear:
    """One weight matrix as the CPU's kernels take it: float (F.linear), or int8 with one scale
    per output channel, multiplied with bfloat16 activations (weight-only quantization), or
    float16 packed for fbgemm (`native`: the CPU decode kernels' `Fp16Linear`, which the whole-
    layer decode step reads too; else torch's quantized op)."""

    __slots__ = ("_packed", "_scale", "_weight", "native")

    def __init__(self, weight: torch.Tensor, precision: str, kernels: Any = None) -> None:
        # weight [N, K], float
        self._scale: torch.Tensor | None = None
        self._packed: Any = None
        self.native: Any = None
        if precision == "float16" and kernels is not None:
            # float16 has no values beyond +-65504: fbgemm's own packing clamps them so too
            self.native = kernels.Fp16Linear(
                weight.detach().float().clamp(-65504.0, 65504.0).contiguous()
            )
            self._weight = weight.new_empty(0)
        elif precision == "int8":
            self._weight, self._scale = quantize_int8(weight)
        elif precision == "float16" and fp16_gemm_available():
            # fbgemm rounds the weights to float16 once, in the layout its kernel reads
            self._packed = torch.ops.quantized.linear_prepack_fp16(
                weight.detach().float().contiguous(), None
            )
            self._weight = weight.new_empty(0)
        else:
            self._weight = weight.to(_DTYPES[precision]).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if self.native is not None:
            return self.native(x)
        if self._packed is not None:
            return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)
        if x.shape[0] >= WIDE_ROWS and x.device.type == "cpu":
            # many rows (a prefill chunk): the product is bound by arithmetic, not by reading
            # the weights, and float32 is the CPU's fast arithmetic; widening the weights once
            # costs 1/T of the product
            w = self._weight.float()
            if self._scale is not None:
                w = w * self._scale.float()[:, None]
            return F.linear(x.float(), w).to(x.dtype)
        if self._scale is not None:
            return torch.ops.aten._weight_int8pack_mm(x, self._weight, self._scale)
        return F.linear(x, self._weight)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in one kernel (`F.rms_norm` composes it from half a
    dozen operators for float32 inputs on a CPU)."""
    return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)[0]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (q [N, K] int8, scale [N] bfloat16), weight ~= q *
    scale. The scale is rounded to bfloat16 first (the kernel takes it so) and the weight
    quantized with the rounded scale, so the rounding costs no accuracy of its own."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1).clamp_min(1e-12) / 127.0).to(torch.bfloat16)  # [N]
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class _Layer:
    __slots__ = ("down", "gate_up", "ln1", "ln2", "native", "o", "qkv")

    def __init__(self, layer: Any, precision: str, dtype: torch.dtype, kernels: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        self.qkv = _Linear(qkv.detach(), precision, kernels)  # [(Hq + 2 Hkv) D, H]
        self.o = _Linear(attn.o_proj.weight.detach(), precision, kernels)
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        self.gate_up = _Linear(gate_up.detach(), precision, kernels)  # [2 I, H]
        self.down = _Linear(mlp.down_proj.weight.detach(), precision, kernels)
        self.ln1 = layer.input_layernorm.weight.detach().to(dtype).contiguous()
        self.ln2 = layer.post_attention_layernorm.weight.detach().to(dtype).contiguous()
        # the layer as the whole-step decode kernel reads it (float16 weights there only)
        self.native: Any = None
        if self.qkv.native is not None:
            self.native = kernels.DecodeLayer(
                self.ln1,
                self.ln2,
                self.qkv.native,
                self.o.native,
                self.gate_up.native,
                self.down.native,
            )


class FusedDecoder:
    """The decoder layers, final norm and output head of a Llama, rearranged for one call per
    step: `run(slices)` is `run_step(decoder, lm_head, slices, mrope=False)`."""

    def __init__(self, decoder: Any, lm_head: Any, config: Any, precision: str) -> None:
        if precision not in _DTYPES:
            raise ValueError(f"the fused step holds {', '.join(_DTYPES)}, not {precision!r}")
        reason = supported(config)
        if reason is not None:
            raise ValueError(f"the fused step does not take this model: {reason}")
        self.precision = precision
        self.dtype = activation_dtype(precision)  # of the activations and the KV
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads or config.num_attention_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.groups = self.heads // self.kv_heads
        self.hidden = int(config.hidden_size)
        self.eps = float(config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.rotary = decoder.rotary_emb
        # the CPU decode kernels where they build (float32 activations on a CPU only): an
        # all-decode step attends through them, and with float16 weights runs every layer there
        kernels = None
        if self.dtype == torch.float32 and lm_head.weight.device.type == "cpu":
            from visiongate_kernels.cpu_decode import load

            kernels = load()
        self._decode_kernel = kernels
        self.layers = [_Layer(layer, precision, self.dtype, kernels) for layer in decoder.layers]
        self._native_layers = [layer.native for layer in self.layers]
        if any(n is None for n in self._native_layers):
            self._native_layers = []
        self.norm = decoder.norm.weight.detach().to(self.dtype)
        self.head = _Linear(lm_head.weight.detach(), precision, kernels)

    def run(self, slices: Sequence[Slice], *, every_row: bool = False) -> torch.Tensor:
        """One packed forward; next-token logits [n, vocab] (float32) of the slices that want
        them, in order (`every_row`: of every position fed, [T, vocab], for perplexity)."""
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        x = torch.cat([s.embeds for s in slices]).to(self.dtype)  # [T, H]
        t = x.shape[0]
        pos = torch.cat([s.positions for s in slices])  # [T]
        cos, sin = self.rotary(x[None], pos[None])  # [1, T, D] each
        half = d // 2
        # rotate_half(x) * sin == roll(x, half) * (sin with its first half negated)
        sign = torch.ones(d, dtype=sin.dtype, device=sin.device)
        sign[:half] = -1
        cos = cos[0, :, None].to(self.dtype)  # [T, 1, D]
        sin = (sin[0, :, None] * sign).to(self.dtype)
        runs, off = [], 0
        for s in slices:
            runs.append((off, s, s.start + s.length))
            off += s.length
        kernel = self._decode_kernel if off == len(slices) else None  # one position each
        starts = [s.start for s in slices] if kernel is not None else []
        whole_step = kernel is not None and bool(self._native_layers)
        if whole_step:  # every layer in one call
            kernel.decode_layers(
                x,
                cos[:, 0].contiguous(),
                sin[:, 0].contiguous(),
                self._native_layers,
                [s.kv.layers for s in slices],
                starts,
                hq,
                hkv,
                self.eps,
                self.scale,
            )
        for i, layer in enumerate(() if whole_step else self.layers):
            h = _rms_norm(x, layer.ln1, self.eps)
            qkv = layer.qkv(h).view(t, hq + 2 * hkv, d)  # [T, Hq + Hkv + Hkv, D]
            qk = qkv[:, : hq + hkv]
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)  # rotary, [T, Hq + Hkv, D]
            q = qk[:, :hq]
            kv_new = torch.stack((qk[:, hq:], qkv[:, hq + hkv :]), dim=1)  # [T, 2, Hkv, D]
            if kernel is not None:  # every slice decodes: writes and attention in one call
                bufs = [s.kv.layers[i] for s in slices]
                a = kernel.decode_attention(q.contiguous(), kv_new, bufs, starts, self.scale)
            else:
                outs = [self._attend(i, q, kv_new, o, s, e) for o, s, e in runs]
                a = outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, Hq D]
            x.add_(layer.o(a))  # x is this step's own tensor (cat)
            h = _rms_norm(x, layer.ln2, self.eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x.add_(layer.down(F.silu(gate, inplace=True) * up))
        for s in slices:
            s.kv.length = max(s.kv.length, s.start + s.length)
        if every_row:
            return self.head(_rms_norm(x, self.norm, self.eps)).float()  # [T, V]
        rows = [o + s.length - 1 for o, s, _ in runs if s.want_logits]
        if not rows:
            return x.new_empty(0, 0)
        picked = x[rows[0] : rows[0] + 1] if len(rows) == 1 else x[rows]  # [n, H]
        return self.head(_rms_norm(picked, self.norm, self.eps)).float()  # [n, V]

    def _attend(
        self, layer: int, q: torch.Tensor, kv_new: torch.Tensor, o: int, s: Slice, end: int
    ) -> torch.Tensor:
        """Write slice `s`'s new keys and values (rows o.. of kv_new [T, 2, Hkv, D]) into its
        buffer, then its queries (rows o.. of q [T, Hq, D], positions [s.start, end)) attend
        causally over the buffer's keys [0, end); returns [n, Hq D]."""
        n, start = s.length, s.start
        buf = s.kv.layers[layer]  # [2, Hkv, cap, D]
        if n == 1:
            buf[:, :, start] = kv_new[o]
            k, v = buf[:, None, :, :end].unbind(0)  # [1, Hkv, end, D] each
            # one query: its heads grouped under their key/value head, no mask, no repeat
            # (4-D, which the CPU's flash kernel takes; 3-D inputs fall back to the math path)
            qg = q[o].view(1, self.kv_heads, self.groups, self.head_dim)  # [1, Hkv, G, D]
            return F.scaled_dot_product_attention(qg, k, v, scale=self.scale).view(1, -1)
        buf[:, :, start:end] = kv_new[o : o + n].permute(1, 2, 0, 3)
        k, v = buf[:, None, :, :end].unbind(0)  # [1, Hkv, end, D] each
        qh = q[o : o + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if start == 0:
            out = F.scaled_dot_product_attention(
                qh, k, v, is_causal=True, scale=self.scale, enable_gqa=self.groups > 1
            )
        else:  # query i sits at position start + i and sees keys 0..start + i
            cols = torch.arange(end, device=q.device)
            mask = cols[None, :] <= torch.arange(start, end, device=q.device)[:, None]  # [n, end]
            out = F.scaled_dot_product_attention(
                qh, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.groups > 1
            )
        return out[0].transpose(0, 1).reshape(n, self.heads * self.head_dim)
