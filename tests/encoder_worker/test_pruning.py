from __future__ import annotations

import pytest
import torch

from encoder_worker.config import EncoderConfig
from encoder_worker.pruning import dynamic_keep_ratio, merge_dropped, prune


def _batch(b: int = 2, n: int = 64, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(b, n, d, generator=g)
    sal = torch.rand(b, n, generator=g)
    keys = torch.randn(b, n, d, generator=g)
    return feats, sal, keys


@pytest.mark.parametrize(("mode", "expected"), [("none", 64), ("random", 16), ("topk", 16)])
def test_fixed_modes_keep_count_order_and_positions(mode, expected):
    feats, sal, keys = _batch()
    cfg = EncoderConfig(pruning=mode, keep_ratio=0.25)
    for i, p in enumerate(prune(feats, sal, keys, cfg, seeds=[1, 2])):
        assert p.tokens.shape == (expected, 16) and p.n_contextual == 0
        pos = p.positions
        assert torch.all(pos[1:] > pos[:-1])  # original spatial order
        assert torch.equal(p.tokens, feats[i, pos])  # positions say where each token came from
        if mode == "topk":
            assert set(pos.tolist()) == set(sal[i].topk(expected).indices.tolist())


def test_random_is_seeded_per_image():
    feats, sal, keys = _batch()
    cfg = EncoderConfig(pruning="random", keep_ratio=0.25)
    a = prune(feats, sal, keys, cfg, seeds=[1, 2])
    b = prune(feats, sal, keys, cfg, seeds=[1, 3])
    assert torch.equal(a[0].positions, b[0].positions)
    assert not torch.equal(a[1].positions, b[1].positions)


def test_dynamic_keep_ratio_follows_concentration():
    n = 100
    spread = torch.ones(1, n)
    peaked = torch.full((1, n), 0.01)
    peaked[0, :3] = 10.0
    middle = torch.linspace(0, 1, n)[None] ** 4
    r = [float(dynamic_keep_ratio(s, 0.5, 0.05, 0.9)) for s in (peaked, middle, spread)]
    assert r[0] < r[1] < r[2]
    assert r[0] == pytest.approx(0.05) and r[2] == pytest.approx(0.5)
    assert float(dynamic_keep_ratio(spread, 0.9, 0.1, 0.3)) == pytest.approx(0.3)  # clamped


def test_dynamic_mode_keeps_fewer_for_concentrated_saliency():
    feats, _, keys = _batch(b=2, n=100)
    sal = torch.ones(2, 100)
    sal[0, 40:44] = 500.0  # image 0: attention on four patches
    cfg = EncoderConfig(
        pruning="dynamic", min_keep_ratio=0.05, max_keep_ratio=0.6, saliency_mass=0.5
    )
    peaked, spread = prune(feats, sal, keys, cfg, seeds=[0, 0])
    assert peaked.tokens.shape[0] == 5 and spread.tokens.shape[0] == 50
    assert set(range(40, 44)) <= set(peaked.positions.tolist())


def test_dynamic_merge_adds_contextual_tokens_within_budget():
    feats, sal, keys = _batch(b=1, n=64)
    cfg = EncoderConfig(
        pruning="dynamic+merge", min_keep_ratio=0.25, max_keep_ratio=0.25, merge_tokens=4
    )
    (p,) = prune(feats, sal, keys, cfg, seeds=[0])
    assert p.tokens.shape[0] == 16 and p.n_contextual == 4
    dominant = p.positions[:12]
    assert torch.all(dominant[1:] > dominant[:-1])
    assert set(dominant.tolist()) == set(sal[0].topk(12).indices.tolist())
    assert not set(p.positions[12:].tolist()) & set(dominant.tolist())  # anchors were dropped ones


def test_merge_averages_each_group():
    feats = torch.arange(12, dtype=torch.float32).view(6, 2)
    keys = torch.tensor([[1.0, 0], [1, 0.1], [0, 1], [0.1, 1], [1, 0.2], [0.2, 1]])
    dropped = torch.arange(6)
    ctx, anchors = merge_dropped(feats, keys, dropped, 2)
    assert anchors.tolist() == [0, 3]
    # tokens 1, 4 follow anchor 0's key; 2, 5 follow anchor 3's
    torch.testing.assert_close(ctx[0], feats[[0, 1, 4]].mean(0))
    torch.testing.assert_close(ctx[1], feats[[3, 2, 5]].mean(0))
    one, _ = merge_dropped(feats, keys, dropped, 1)
    torch.testing.assert_close(one[0], feats.mean(0))
