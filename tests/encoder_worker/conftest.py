"""Fixtures: real sample photos as JPEG bytes, tiny CLIP / SigLIP checkpoints on disk."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import skimage.data
import torch
from PIL import Image


def encode_image(arr: np.ndarray, fmt: str = "JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.fixture(scope="session")
def photos() -> dict[str, bytes]:
    """skimage sample photos, JPEG-encoded."""
    return {
        name: encode_image(getattr(skimage.data, name)(), quality=92)
        for name in ("astronaut", "chelsea", "coffee", "rocket")
    }


def _save(model, path: Path) -> str:
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory) -> str:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    cfg = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    return _save(CLIPVisionModel(cfg).eval(), tmp_path_factory.mktemp("tiny-clip"))


@pytest.fixture(scope="session")
def tiny_siglip_dir(tmp_path_factory) -> str:
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(1)
    cfg = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    return _save(SiglipVisionModel(cfg).eval(), tmp_path_factory.mktemp("tiny-siglip"))
