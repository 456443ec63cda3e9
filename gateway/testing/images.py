"""Real photos for tests and benchmarks, and the data URLs that carry them in a request.

The photos are scikit-image's sample images (astronaut, chelsea, coffee, rocket, camera, ...),
so a test sends real pixels without shipping image files. `photo_bytes` encodes one the same
way every call (same name and arguments: same bytes, so the same digest and cache key);
`unique_photo` gives bytes no earlier call in this process gave, for a genuine cache miss.
Pillow and scikit-image are imported on first use, not with the module.
"""

from __future__ import annotations

import base64
import io
import itertools
from typing import TYPE_CHECKING

__all__ = ("data_url", "photo_array", "photo_bytes", "unique_photo")

if TYPE_CHECKING:
    import numpy as np


def data_url(data: bytes, mime: str = "image/jpeg") -> str:
    """`data` as a `data:<mime>;base64,...` URL; `mime` is declared as given, never sniffed (a
    test may declare a type the bytes are not)."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def photo_array(name: str = "astronaut") -> np.ndarray:
    """A scikit-image sample photo as its array, as scikit-image gives it (a grey one stays
    two-dimensional)."""
    from skimage import data

    return getattr(data, name)()


def photo_bytes(
    name: str = "astronaut", fmt: str = "JPEG", size: int | None = None, quality: int = 90
) -> bytes:
    """A sample photo in RGB, resized to `size` x `size` if given, encoded as `fmt` (`quality`
    applies to JPEG only)."""
    from PIL import Image

    img = Image.fromarray(photo_array(name))
    if img.mode != "RGB":
        img = img.convert("RGB")
    if size is not None:
        img = img.resize((size, size))
    buf = io.BytesIO()
    if fmt == "JPEG":
        img.save(buf, format=fmt, quality=quality)
    else:
        img.save(buf, format=fmt)
    return buf.getvalue()


_unique_counter = itertools.count(1)


def unique_photo(name: str = "astronaut") -> bytes:
    """A sample photo as JPEG whose bytes no earlier call in this process gave (a different
    1-16 px crop each call, 256 of them before the crops repeat), so a gateway's first encode of
    it is a genuine cache miss."""
    from PIL import Image

    n = next(_unique_counter)
    img = Image.fromarray(photo_array(name)).convert("RGB")
    w, h = img.size
    img = img.crop((n % 16, n // 16 % 16, w - 1, h - 1))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()
