"""Fixtures: real sample photos as JPEG bytes, tiny CLIP / SigLIP checkpoints on disk
(`tests.conftest.tiny_vision_tower`)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from gateway.testing.images import photo_bytes
from tests.conftest import tiny_vision_tower


def encode_image(arr: np.ndarray, fmt: str = "JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.fixture(scope="session")
def photos() -> dict[str, bytes]:
    """skimage sample photos, JPEG-encoded."""
    return {
        name: photo_bytes(name, quality=92) for name in ("astronaut", "chelsea", "coffee", "rocket")
    }


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory) -> str:
    return tiny_vision_tower("clip", tmp_path_factory.mktemp("tiny-clip"), seed=0)


@pytest.fixture(scope="session")
def tiny_siglip_dir(tmp_path_factory) -> str:
    return tiny_vision_tower("siglip", tmp_path_factory.mktemp("tiny-siglip"), seed=1)
