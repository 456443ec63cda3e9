from __future__ import annotations

import pytest
import torch

from encoder_worker.config import EncoderConfig
from encoder_worker.pipeline import EncoderPipeline
from encoder_worker.tower import VisionTower, build_tower, cls_attention_row, describe_tower


def _hf_reference(path: str, cls, pixels: torch.Tensor, feature_layer: int):
    model = cls.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(pixel_values=pixels, output_hidden_states=True, output_attentions=True)
    return out


def _pixels_and_rows(tower: VisionTower, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s, p = tower.image_size, tower.patch_size
    pixels = torch.randn(2, 3, s, s, generator=g)  # [B, 3, S, S]
    n = s // p
    rows = pixels.view(2, 3, n, p, n, p).permute(0, 2, 4, 1, 3, 5).reshape(2, n * n, 3 * p * p)
    return pixels, rows


@pytest.mark.parametrize("feature_layer", [-2, -1, 1])
def test_clip_checkpoint_features_and_cls_saliency(tiny_clip_dir, feature_layer):
    from transformers import CLIPVisionModel

    tower, info = build_tower(tiny_clip_dir, feature_layer, seed=0)
    assert info.kind == "clip" and info.spec.resize == "shortest_edge_crop"
    assert len(tower.layers) == (feature_layer if feature_layer > 0 else 4 + feature_layer)
    pixels, rows = _pixels_and_rows(tower)
    with torch.no_grad():
        out = tower(rows)
    ref = _hf_reference(tiny_clip_dir, CLIPVisionModel, pixels, feature_layer)
    torch.testing.assert_close(
        out.features, ref.hidden_states[feature_layer][:, 1:], atol=1e-5, rtol=1e-4
    )
    # the CLS row, computed alone, equals row 0 of the full attention map of the last layer run
    attn = ref.attentions[len(tower.layers) - 1]  # [B, H, T, T]
    torch.testing.assert_close(out.saliency, attn[:, :, 0, 1:].sum(1), atol=1e-5, rtol=1e-4)


def test_siglip_checkpoint_uses_norm_saliency(tiny_siglip_dir):
    from transformers import SiglipVisionModel

    tower, info = build_tower(tiny_siglip_dir, -2, seed=0)
    assert info.kind == "siglip" and info.spec.resize == "squash" and info.spec.mean == (0.5,) * 3
    pixels, rows = _pixels_and_rows(tower, seed=1)
    with torch.no_grad():
        out = tower(rows)
    ref = _hf_reference(tiny_siglip_dir, SiglipVisionModel, pixels, -2)
    torch.testing.assert_close(out.features, ref.hidden_states[-2], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(
        out.saliency, ref.hidden_states[-2].norm(dim=-1), atol=1e-4, rtol=1e-4
    )


def test_cls_attention_row_equals_the_slow_way():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 10, 8, generator=g)
    k = torch.randn(2, 3, 10, 8, generator=g)
    full = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1)  # [B, H, T, T]
    torch.testing.assert_close(cls_attention_row(q[:, :, 0], k), full[:, :, 0].sum(1))


def test_synthetic_towers_are_seeded_and_shaped():
    b16 = describe_tower("vit-b16-224", seed=0)
    l14 = describe_tower("vit-l14-336", seed=0)
    assert (b16.hidden_size, b16.spec.num_patches) == (768, 196)
    assert (l14.hidden_size, l14.spec.num_patches) == (1024, 576)
    assert describe_tower("vit-b16-224", seed=1).weights_id != b16.weights_id


def test_checkpoint_through_the_config_path(tiny_clip_dir, tiny_siglip_dir, photos):
    for path in (tiny_clip_dir, tiny_siglip_dir):
        pipe = EncoderPipeline(
            EncoderConfig(tower=path, pruning="topk", keep_ratio=0.5), hidden_size=24
        )
        try:
            results = pipe.encode_batch([photos["coffee"], photos["rocket"]])
        finally:
            pipe.close()
        for r in results:
            assert r.tokens_total == 16 and r.tokens_kept == 8
            assert r.embeds().shape == (8, 24)
