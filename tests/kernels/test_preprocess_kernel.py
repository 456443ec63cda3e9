from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from visiongate_kernels.resize_patchify import (
    ResizeCrop,
    resize_normalize_patchify,
    resize_normalize_patchify_ref,
    resize_taps,
)

MEAN = (0.48, 0.46, 0.41)
STD = (0.27, 0.26, 0.28)


def _image(h: int, w: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("kind", ["bicubic", "bilinear"])
@pytest.mark.parametrize(
    ("h", "w", "rh", "rw", "top", "left"),
    [
        (37, 53, 16, 22, 0, 3),  # downscale, crop columns
        (40, 24, 26, 16, 5, 0),  # portrait, crop rows
        (7, 5, 16, 16, 0, 0),  # upscale, squash
    ],
)
def test_kernel_matches_reference(kernel_device, kind, h, w, rh, rw, top, left):
    img = _image(h, w)
    geom = ResizeCrop(rh, rw, top, left, 16, 16, kind)
    exact = resize_normalize_patchify_ref(img, geom, MEAN, STD, 8, torch.empty(4, 192), exact=True)
    out = resize_normalize_patchify(img.to(kernel_device), geom, MEAN, STD, 8, impl="triton")
    assert out.shape == exact.shape == (4, 3 * 8 * 8)
    # the kernel's own taps vs torch's interpolate: the same filter, computed independently
    torch.testing.assert_close(out.cpu(), exact, atol=2e-4, rtol=1e-4)
    # the fast CPU reference rounds and clamps to whole levels between its two passes, as Pillow
    # does (bicubic overshoot on this noise image is clipped): close on average
    fast = resize_normalize_patchify(img, geom, MEAN, STD, 8, impl="torch")
    assert (fast - exact).abs().mean() <= 1.0 / (255 * min(STD))


def test_kernel_writes_half_precision_rows(kernel_device):
    img = _image(20, 20, seed=1)
    geom = ResizeCrop(16, 16, 0, 0, 16, 16, "bicubic")
    exact = resize_normalize_patchify_ref(img, geom, MEAN, STD, 8, torch.empty(4, 192), exact=True)
    out = torch.empty(4, 192, dtype=torch.float16, device=kernel_device)
    resize_normalize_patchify(img.to(kernel_device), geom, MEAN, STD, 8, out=out, impl="triton")
    torch.testing.assert_close(out.float().cpu(), exact, atol=1e-2, rtol=1e-2)


def test_taps_are_normalized_and_in_bounds():
    for in_size, out_size in [(500, 224), (224, 224), (100, 224), (3000, 224)]:
        starts, weights = resize_taps(in_size, out_size, "bicubic")
        torch.testing.assert_close(weights.sum(1), torch.ones(out_size), atol=1e-5, rtol=0)
        assert int(starts.min()) >= 0 and int(starts.max()) < in_size


@pytest.mark.parametrize(
    ("kind", "pil"), [("bicubic", Image.BICUBIC), ("bilinear", Image.BILINEAR)]
)
def test_reference_resize_agrees_with_pillow(kind, pil):
    """Same filter family as Pillow's resize (Pillow rounds to uint8 between passes)."""
    img = _image(96, 80, seed=2).numpy()
    img = np.asarray(Image.fromarray(img).filter(ImageFilter.SMOOTH))
    out = torch.empty(30, 3 * 8 * 8)
    geom = ResizeCrop(48, 40, 0, 0, 48, 40, kind)
    resize_normalize_patchify_ref(
        torch.from_numpy(img.copy()), geom, (0, 0, 0), (1 / 255,) * 3, 8, out, exact=True
    )
    ours = out.view(6, 5, 3, 8, 8).permute(0, 3, 1, 4, 2).reshape(48, 40, 3).numpy()
    theirs = np.asarray(Image.fromarray(img).resize((40, 48), pil), dtype=np.float32)
    diff = np.abs(ours - theirs)
    assert diff.max() <= 3.0 and diff.mean() < 0.6
