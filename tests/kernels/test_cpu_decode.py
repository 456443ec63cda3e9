"""The CPU decode kernels (kernels/cpu_decode.py) against torch computing the same op by op.

- decode attention: for a batch of sequences of different lengths, each with its own KV buffer,
  the new key/value rows land at each sequence's position, and each sequence's grouped query
  heads attend over its own positions [0, position] as `F.scaled_dot_product_attention` does;
- `Fp16Linear`: the product with the weights rounded to float16, in float32 arithmetic;
- `decode_layers`: a decode step through several random Llama layers equals the fused step's
  computation done with torch's operators (norms, rotary, attention, SiLU, residuals), and
  every layer's KV rows are written.
Bad inputs are refused with an error, not read out of bounds."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from visiongate_kernels.cpu_decode import load

kernel = load()
pytestmark = pytest.mark.skipif(
    kernel is None and shutil.which("c++") is None, reason="no C++ compiler on this machine"
)


def test_it_builds_where_a_compiler_is() -> None:
    assert kernel is not None, "a C++ compiler is here, yet the kernel did not build"


def _reference(q, kv_new, bufs, starts, scale):
    out = []
    hkv = kv_new.shape[2]
    for b, (buf, start) in enumerate(zip(bufs, starts, strict=True)):
        buf[:, :, start] = kv_new[b]
        k, v = buf[:, None, :, : start + 1].unbind(0)
        qg = q[b].view(1, hkv, q.shape[1] // hkv, q.shape[2])
        out.append(F.scaled_dot_product_attention(qg, k, v, scale=scale).view(1, -1))
    return torch.cat(out)


@pytest.mark.parametrize(("hq", "hkv"), [(9, 3), (4, 4)])
def test_matches_torch_attention_and_writes_the_new_rows(hq: int, hkv: int) -> None:
    g = torch.Generator().manual_seed(0)
    d, starts = 64, [0, 5, 130, 257]
    bufs = [torch.randn(2, hkv, cap, d, generator=g) for cap in (8, 16, 256, 300)]
    ref_bufs = [b.clone() for b in bufs]
    q = torch.randn(len(starts), hq, d, generator=g)
    kv_new = torch.randn(len(starts), 2, hkv, d, generator=g)
    got = kernel.decode_attention(q, kv_new, bufs, starts, d**-0.5)
    want = _reference(q, kv_new, ref_bufs, starts, d**-0.5)
    assert got.shape == (len(starts), hq * d)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    for b, r in zip(bufs, ref_bufs, strict=True):
        assert torch.equal(b, r)  # the same rows written, nothing else touched


def test_bad_inputs_are_refused() -> None:
    q = torch.randn(1, 9, 64)
    kv_new = torch.randn(1, 2, 3, 64)
    buf = torch.zeros(2, 3, 8, 64)
    with pytest.raises(RuntimeError, match="beyond its buffer"):
        kernel.decode_attention(q, kv_new, [buf], [8], 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.decode_attention(q.bfloat16(), kv_new, [buf], [0], 0.125)
    with pytest.raises(RuntimeError, match="one buffer and one position"):
        kernel.decode_attention(q, kv_new, [buf, buf], [0, 1], 0.125)
    with pytest.raises(RuntimeError, match="capacity"):
        kernel.decode_attention(q, kv_new, [torch.zeros(2, 3, 8, 32)], [0], 0.125)


def test_fp16_linear_multiplies_float16_weights_in_float32() -> None:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 80, generator=g)
    weight[3, 7] = 1e6  # beyond float16's range: clamped to its largest value, not inf
    lin = kernel.Fp16Linear(weight.clamp(-65504.0, 65504.0))
    assert (lin.in_features, lin.out_features) == (80, 96)
    for rows in (1, 5, 40):  # one decode row, a few, a prefill chunk
        x = torch.randn(rows, 80, generator=g)
        want = x @ weight.clamp(-65504.0, 65504.0).half().float().T
        got = lin(x)
        assert got.shape == (rows, 96) and got.dtype == torch.float32
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-3), (got - want).abs().max()
    assert lin(torch.randn(0, 80)).shape == (0, 96)
    with pytest.raises(RuntimeError, match=r"float32 \[T, 80\]"):
        lin(torch.randn(2, 81))
    with pytest.raises(RuntimeError, match="float32"):
        lin(torch.randn(2, 80).bfloat16())


def _layer(g, h: int, hq: int, hkv: int, d: int, inter: int):
    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=g) / k**0.5

    ws = {
        "qkv": w((hq + 2 * hkv) * d, h),
        "o": w(h, hq * d),
        "gate_up": w(2 * inter, h),
        "down": w(h, inter),
    }
    ln1, ln2 = 1 + 0.1 * torch.randn(h, generator=g), 1 + 0.1 * torch.randn(h, generator=g)
    native = kernel.DecodeLayer(ln1, ln2, *(kernel.Fp16Linear(ws[k]) for k in ws))
    half = {k: v.half().float() for k, v in ws.items()}  # what the kernel multiplies with
    return native, half, ln1, ln2


def _reference_layers(x, cos, sin, layers, kv, starts, hq, hkv, eps, scale):
    """The decode step as the fused step's Python loop computes it, float32 throughout."""
    d = cos.shape[1]
    half_d = d // 2
    for i, (_, w, ln1, ln2) in enumerate(layers):
        h = torch.nn.functional.rms_norm(x, (x.shape[1],), ln1, eps)
        qkv = (h @ w["qkv"].T).view(len(x), hq + 2 * hkv, d)
        qk = qkv[:, : hq + hkv]
        qk = qk * cos[:, None] + qk.roll(half_d, -1) * sin[:, None]
        kv_new = torch.stack((qk[:, hq:], qkv[:, hq + hkv :]), dim=1).contiguous()
        a = _reference(qk[:, :hq].contiguous(), kv_new, [k[i] for k in kv], starts, scale)
        x = x + a @ w["o"].T
        h = torch.nn.functional.rms_norm(x, (x.shape[1],), ln2, eps)
        gate, up = (h @ w["gate_up"].T).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ w["down"].T
    return x


def test_decode_layers_match_the_step_computed_op_by_op() -> None:
    g = torch.Generator().manual_seed(2)
    h, hq, hkv, d, inter, n_layers = 64, 6, 2, 32, 96, 3
    layers = [_layer(g, h, hq, hkv, d, inter) for _ in range(n_layers)]
    starts = [0, 4, 37]
    kv = [[torch.randn(2, hkv, 48, d, generator=g) for _ in range(n_layers)] for _ in starts]
    ref_kv = [[b.clone() for b in seq] for seq in kv]
    x = torch.randn(len(starts), h, generator=g)
    angle = torch.randn(len(starts), d // 2, generator=g)
    cos = torch.cat([angle.cos(), angle.cos()], dim=1)
    sin = torch.cat([-angle.sin(), angle.sin()], dim=1)  # the first half negated
    want = _reference_layers(x.clone(), cos, sin, layers, ref_kv, starts, hq, hkv, 1e-5, d**-0.5)
    got = x.clone()
    kernel.decode_layers(got, cos, sin, [n for n, *_ in layers], kv, starts, hq, hkv, 1e-5, d**-0.5)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()
    for seq, ref in zip(kv, ref_kv, strict=True):
        for buf, r in zip(seq, ref, strict=True):
            assert torch.allclose(buf, r, rtol=1e-5, atol=1e-5)  # each layer's new rows


def test_decode_layers_refuse_what_does_not_fit() -> None:
    g = torch.Generator().manual_seed(3)
    native, *_ = _layer(g, 64, 6, 2, 32, 96)
    x = torch.randn(1, 64)
    cos, sin = torch.randn(1, 32), torch.randn(1, 32)
    kv = [[torch.zeros(2, 2, 8, 32)]]
    with pytest.raises(RuntimeError, match="do not match"):
        kernel.decode_layers(x, cos, sin, [native], kv, [0], 4, 2, 1e-5, 0.1)  # 4 heads, not 6
    with pytest.raises(RuntimeError, match="one KV buffer a layer"):
        kernel.decode_layers(x, cos, sin, [native, native], kv, [0], 6, 2, 1e-5, 0.1)
    with pytest.raises(RuntimeError, match="beyond its buffer"):
        kernel.decode_layers(x, cos, sin, [native], kv, [8], 6, 2, 1e-5, 0.1)
    with pytest.raises(RuntimeError, match="one KV list and one position"):
        kernel.decode_layers(x, cos, sin, [native], kv, [0, 1], 6, 2, 1e-5, 0.1)
