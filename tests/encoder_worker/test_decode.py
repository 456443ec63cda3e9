from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from encoder_worker.decode import apply_orientation, decode_image
from encoder_worker.types import ImageError

from .conftest import encode_image

MB = 1 << 20


def _decode(data: bytes, **kw) -> np.ndarray:
    return decode_image(data, kw.pop("max_bytes", 20 * MB), kw.pop("max_pixels", 40_000_000), **kw)


def _code(data: bytes, **kw) -> str:
    with pytest.raises(ImageError) as info:
        _decode(data, **kw)
    return info.value.code


def _png_claiming(width: int, height: int) -> bytes:
    """A ~100-byte PNG whose header claims width x height pixels: a decompression bomb."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def test_decompression_bomb_is_refused_from_the_header():
    assert _code(_png_claiming(50_000, 50_000)) == "image_too_large"
    assert _code(_png_claiming(3000, 3000), max_pixels=1_000_000) == "image_too_large"


def test_byte_limit():
    data = encode_image(np.zeros((64, 64, 3), np.uint8), "PNG")
    assert _code(data, max_bytes=len(data) - 1) == "image_too_large"
    assert _decode(data, max_bytes=len(data)).shape == (64, 64, 3)


@pytest.mark.parametrize(
    "data", [b"", b"hello world", b"\x89PNG\r\n\x1a\n" + b"\0" * 40, b"\xff\xd8\xff" + b"\x00" * 10]
)
def test_not_an_image(data):
    assert _code(data) == "invalid_image"


def test_truncated_jpeg(photos):
    data = photos["chelsea"]
    assert _code(data[: len(data) // 2]) == "invalid_image"


def test_unsupported_formats():
    arr = np.zeros((16, 16, 3), np.uint8)
    assert _code(encode_image(arr, "TIFF")) == "unsupported_image_format"
    assert _code(b"%PDF-1.7\n...") == "unsupported_image_format"
    assert _code(b'<svg xmlns="http://www.w3.org/2000/svg"/>') == "unsupported_image_format"


def test_exif_orientation_is_applied():
    arr = np.zeros((20, 40, 3), np.uint8)
    arr[:, :20] = (255, 0, 0)  # left half red
    img = Image.fromarray(arr)
    exif = img.getexif()
    exif[0x0112] = 6  # stored sideways: display rotated 90 degrees clockwise
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif.tobytes(), quality=95)
    out = _decode(buf.getvalue())
    assert out.shape == (40, 20, 3)
    assert out[5, 10, 0] > 200 and out[5, 10, 1] < 60  # red ends up on top
    assert out[35, 10, 0] < 60


@pytest.mark.parametrize("orientation", range(1, 9))
def test_tensor_orientation_matches_pillow(orientation):
    arr = np.arange(3 * 4 * 3, dtype=np.uint8).reshape(3, 4, 3)
    img = Image.fromarray(arr)
    exif = img.getexif()
    exif[0x0112] = orientation
    img.info["exif"] = exif.tobytes()
    img.getexif()[0x0112] = orientation
    expected = np.asarray(ImageOps.exif_transpose(img))
    got = apply_orientation(torch.from_numpy(arr), orientation).numpy()
    assert np.array_equal(got, expected)


def test_rgba_is_composited_on_white_and_grayscale_becomes_rgb():
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[:4] = (10, 20, 30, 255)  # opaque top half, transparent bottom half
    out = _decode(encode_image(rgba, "PNG"))
    assert out.shape == (8, 8, 3)
    assert out[0, 0].tolist() == [10, 20, 30] and out[7, 7].tolist() == [255, 255, 255]
    gray = np.full((8, 8), 77, np.uint8)
    out = _decode(encode_image(gray, "PNG"))
    assert out.shape == (8, 8, 3) and out[3, 3].tolist() == [77, 77, 77]
    pal = Image.fromarray(np.full((8, 8, 3), 200, np.uint8)).convert("P")
    buf = io.BytesIO()
    pal.save(buf, "GIF")
    assert _decode(buf.getvalue()).shape == (8, 8, 3)


def test_big_images_are_reduced_but_keep_twice_the_needed_side():
    arr = np.random.default_rng(0).integers(0, 256, (1200, 1600, 3), dtype=np.uint8)
    for fmt in ("JPEG", "PNG"):
        out = _decode(encode_image(arr, fmt), min_side=224)
        assert 448 <= min(out.shape[:2]) < 1200
        assert abs(out.shape[1] / out.shape[0] - 4 / 3) < 0.02


@pytest.mark.parametrize("mode", ["P", "1", "I;16"])
def test_large_palette_bilevel_and_16bit_images_decode_reduced(mode: str) -> None:
    img = (
        Image.new("RGB", (1000, 1000), (10, 200, 30)).convert("P")
        if mode == "P"
        else Image.new(mode, (1000, 1000))
    )
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    arr = decode_image(buf.getvalue(), 10**7, 10**8, min_side=224)
    assert arr.shape[2] == 3 and min(arr.shape[:2]) >= 448


def test_elongated_images_are_windowed_before_resizing() -> None:
    from encoder_worker.patch_rows import PreprocessSpec, center_window, preprocess_batch

    spec = PreprocessSpec(image_size=224, patch_size=16)
    strip = torch.zeros(1, 100_000, 3, dtype=torch.uint8)  # resized whole: 224 x 22.4M pixels
    window = center_window(strip, spec)
    assert window.shape[0] == 1 and window.shape[1] < 16
    normal = torch.zeros(300, 400, 3, dtype=torch.uint8)
    assert center_window(normal, spec) is normal  # ordinary aspect ratios are untouched
    out = preprocess_batch([strip], spec, torch.device("cpu"), torch.float32)
    assert out.shape == (1, 196, 768)
