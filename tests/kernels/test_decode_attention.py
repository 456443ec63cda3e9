"""The decode-attention kernel (kernels/decode_attention.cpp) against torch's attention.

For a batch of sequences of different lengths, each with its own KV buffer: the new key/value
rows land at each sequence's position, and each sequence's grouped query heads attend over its
own positions [0, position] as `F.scaled_dot_product_attention` does. Bad inputs are refused
with an error, not read out of bounds."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from visiongate_kernels.decode_attention import load

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
