from __future__ import annotations

import numpy as np
import skimage.data
import torch

from encoder_worker.patch_rows import PreprocessSpec, pil_preprocess, preprocess_batch, resize_plan


def _as_image(rows: torch.Tensor, spec: PreprocessSpec) -> np.ndarray:
    """[N, 3*P*P] patch rows -> [3, S, S], inverting the patch layout."""
    g, p = spec.grid, spec.patch_size
    return rows.view(g, g, 3, p, p).permute(2, 0, 3, 1, 4).reshape(3, g * p, g * p).numpy()


def test_resize_plan():
    spec = PreprocessSpec(image_size=224, patch_size=16)
    assert resize_plan(512, 512, spec) == (224, 224, 0, 0)
    assert resize_plan(300, 451, spec) == (224, 336, 0, 56)
    assert resize_plan(600, 300, spec) == (448, 224, 112, 0)
    squash = PreprocessSpec(image_size=224, patch_size=16, resize="squash")
    assert resize_plan(300, 451, squash) == (224, 224, 0, 0)


def test_fused_preprocess_matches_the_pillow_pipeline():
    for arr in (skimage.data.chelsea(), skimage.data.rocket()):
        for spec in (
            PreprocessSpec(image_size=224, patch_size=16),
            PreprocessSpec(
                image_size=64,
                patch_size=8,
                resize="squash",
                resample="bilinear",
                mean=(0.5,) * 3,
                std=(0.5,) * 3,
            ),
        ):
            rows = preprocess_batch(
                [torch.from_numpy(arr.copy())], spec, torch.device("cpu"), torch.float32
            )
            assert rows.shape == (1, spec.num_patches, 3 * spec.patch_size**2)
            ours = _as_image(rows[0], spec)
            ref = pil_preprocess(arr, spec)
            # Pillow rounds to uint8 between its two passes; the fused path stays in float
            diff = np.abs(ours - ref) * 255 * min(spec.std)
            assert diff.mean() < 0.5 and np.percentile(diff, 99.9) < 3.0


def test_patch_rows_feed_a_conv_patch_embedding_identically():
    """Patch row layout is (c, y, x), the order a Conv2d patch embedding flattens its weight in."""
    spec = PreprocessSpec(image_size=32, patch_size=8)
    arr = skimage.data.astronaut()
    rows = preprocess_batch(
        [torch.from_numpy(arr.copy())], spec, torch.device("cpu"), torch.float32
    )
    conv = torch.nn.Conv2d(3, 5, 8, 8, bias=False)
    pixels = torch.from_numpy(_as_image(rows[0], spec))[None]
    expected = conv(pixels).flatten(2).transpose(1, 2)  # [1, N, 5]
    got = rows @ conv.weight.reshape(5, -1).T
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
