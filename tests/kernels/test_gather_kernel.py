from __future__ import annotations

import torch

from visiongate_kernels.gather import gather_tokens, gather_tokens_ref, topk_sorted


def test_topk_sorted_keeps_the_best_in_spatial_order():
    scores = torch.tensor([[0.1, 0.9, 0.3, 0.8, 0.2], [5.0, 4.0, 3.0, 2.0, 1.0]])
    idx = topk_sorted(scores, torch.tensor([2, 3]))
    assert idx.tolist() == [[1, 3, -1], [0, 1, 2]]


def test_gather_kernel_matches_reference(kernel_device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 20, 40, generator=g)
    idx = topk_sorted(torch.rand(3, 20, generator=g), torch.tensor([5, 2, 7]))
    ref = gather_tokens_ref(x, idx)
    out = gather_tokens(x.to(kernel_device), idx.to(kernel_device), impl="triton")
    assert torch.equal(out.cpu(), ref)
    assert torch.equal(ref[1, 2:], torch.zeros(5, 40))  # padding slots are zero
    assert torch.equal(ref[0, 0], x[0, int(idx[0, 0])])
