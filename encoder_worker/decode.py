"""Image bytes -> uint8 RGB pixels, with every guard applied before any pixel is decoded.

Order of checks: byte size, format sniffing (only JPEG, PNG, WebP, GIF and BMP are decoded;
other recognised formats are `unsupported_image_format`), header dimensions against
`max_pixels` (this is the decompression-bomb guard: a 40 kB PNG that claims 50k x 50k pixels is
refused from its header), then the decode itself (truncated or corrupt data -> `invalid_image`),
EXIF orientation and conversion to RGB (transparency is composited on white).

A big JPEG is decoded straight at a reduced scale (`Image.draft`, DCT scaling) and other big
images are box-reduced right after decode, as long as the result keeps at least twice the
resolution the tower needs: the antialiased resize that follows sees the same content for
less work.

On CUDA with torchvision importable, `decode_jpeg_cuda` decodes JPEGs with nvJPEG on the device.
"""

from __future__ import annotations

import io
import warnings
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from encoder_worker.types import ImageError

if TYPE_CHECKING:
    import torch

__all__ = (
    "ALLOWED_FORMATS",
    "apply_orientation",
    "check_image",
    "decode_image",
    "decode_jpeg_cuda",
    "torchvision_jpeg_available",
)

ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")

# recognised but refused: say so instead of calling them corrupt
_UNSUPPORTED_MAGIC = (
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"8BPS", "PSD"),
    (b"%PDF", "PDF"),
    (b"%!PS", "EPS"),
    (b"\xc5\xd0\xd3\xc6", "EPS"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"\xffO\xffQ", "JPEG 2000"),
    (b"<svg", "SVG"),
    (b"<?xml", "SVG"),
    (b"qoif", "QOI"),
)


def _sniff_unsupported(data: bytes) -> str | None:
    head = data[:32]
    for magic, name in _UNSUPPORTED_MAGIC:
        if head.startswith(magic):
            return name
    if head[4:8] == b"ftyp":  # ISO media: HEIC / AVIF
        return "HEIF/AVIF"
    return None


def check_image(data: bytes, max_image_bytes: int, max_pixels: int) -> Image.Image:
    """Open `data` lazily (header only) and enforce size, format and pixel limits."""
    if len(data) > max_image_bytes:
        raise ImageError(
            "image_too_large", f"image is {len(data)} bytes; the limit is {max_image_bytes}"
        )
    if not data:
        raise ImageError("invalid_image", "empty image data")
    if fmt := _sniff_unsupported(data):
        raise ImageError("unsupported_image_format", f"{fmt} images are not supported")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError("image_too_large", f"decompression bomb refused: {exc}") from None
    except UnidentifiedImageError:
        raise ImageError("invalid_image", "data is not a recognised image") from None
    except Exception as exc:
        raise ImageError("invalid_image", f"cannot read image header: {exc}") from None
    w, h = img.size
    if w <= 0 or h <= 0:
        raise ImageError("invalid_image", f"image has no pixels ({w}x{h})")
    if w * h > max_pixels:
        raise ImageError(
            "image_too_large", f"image is {w}x{h} = {w * h} pixels; the limit is {max_pixels}"
        )
    return img


_REDUCIBLE = frozenset(("L", "LA", "RGB", "RGBA", "RGBX", "CMYK", "I", "F"))


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit grayscale: scale to 8 bits rather than clipping at 255
        arr = np.asarray(img, dtype=np.uint32)
        return Image.fromarray((arr >> 8).astype(np.uint8), "L").convert("RGB")
    return img.convert("RGB")


def decode_image(
    data: bytes, max_image_bytes: int, max_pixels: int, min_side: int = 0
) -> np.ndarray:
    """Decode `data` to a [H, W, 3] uint8 RGB array (EXIF orientation applied).

    `min_side`: the shorter side the caller needs; a bigger image may be decoded or reduced
    down to no less than twice that. Raises `ImageError` for every bad input.
    """
    img = check_image(data, max_image_bytes, max_pixels)
    try:
        want = 2 * min_side
        if want and min(img.size) >= 2 * want:
            if img.format == "JPEG":
                w, h = img.size
                ratio = want / min(w, h)
                img.draft("RGB", (max(1, int(w * ratio)), max(1, int(h * ratio))))
            img.load()
            if img.mode not in _REDUCIBLE:
                # Image.reduce refuses palette, 1-bit and 16-bit modes: orient and convert first
                img = _to_rgb(ImageOps.exif_transpose(img))
            factor = min(img.size) // want
            if factor >= 2:
                img = img.reduce(factor)
        else:
            img.load()
        img = ImageOps.exif_transpose(img)
        img = _to_rgb(img)
        arr = np.array(img, dtype=np.uint8)  # a writable copy: torch.from_numpy wants one
    except ImageError:
        raise
    except (Image.DecompressionBombError, MemoryError) as exc:
        raise ImageError("image_too_large", f"image too large to decode: {exc}") from None
    except Exception as exc:
        raise ImageError("invalid_image", f"cannot decode image: {exc}") from None
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ImageError("invalid_image", f"decoded to unexpected shape {arr.shape}")
    return arr


def apply_orientation(x: torch.Tensor, orientation: int) -> torch.Tensor:
    """Apply EXIF orientation (1..8) to a [H, W, C] tensor, as `ImageOps.exif_transpose` does."""
    if orientation == 2:
        return x.flip(1)
    if orientation == 3:
        return x.flip(0, 1)
    if orientation == 4:
        return x.flip(0)
    if orientation == 5:
        return x.transpose(0, 1)
    if orientation == 6:
        return x.rot90(-1, (0, 1))
    if orientation == 7:
        return x.transpose(0, 1).flip(0, 1)
    if orientation == 8:
        return x.rot90(1, (0, 1))
    return x


_TORCHVISION_JPEG: bool | None = None


def torchvision_jpeg_available() -> bool:
    """True when torchvision imports here and CUDA is present (nvJPEG decode is usable)."""
    global _TORCHVISION_JPEG
    if _TORCHVISION_JPEG is None:
        import torch

        ok = torch.cuda.is_available()
        if ok:
            try:
                import torchvision.io  # noqa: F401
            except Exception:
                ok = False
        _TORCHVISION_JPEG = ok
    return _TORCHVISION_JPEG


def decode_jpeg_cuda(
    datas: list[bytes], max_image_bytes: int, max_pixels: int, device: torch.device
) -> list[torch.Tensor | ImageError]:
    """nvJPEG-decode JPEGs on `device` -> [H, W, 3] uint8 CUDA tensors (or the ImageError).

    The same header guards as `decode_image` run first on the CPU. CMYK and other JPEG flavours
    nvJPEG does not take come back as CPU-decoded tensors moved to the device.
    """
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    results: list[torch.Tensor | ImageError] = [None] * len(datas)  # type: ignore[list-item]
    batch: list[tuple[int, torch.Tensor, int]] = []
    for i, data in enumerate(datas):
        try:
            img = check_image(data, max_image_bytes, max_pixels)
            if img.format == "JPEG" and img.mode in ("RGB", "L"):
                orientation = int(img.getexif().get(0x0112, 1) or 1)
                raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                batch.append((i, raw, orientation))
            else:
                arr = decode_image(data, max_image_bytes, max_pixels)
                results[i] = torch.from_numpy(arr).to(device, non_blocking=True)
        except ImageError as exc:
            results[i] = exc
    if batch:
        try:
            decoded = decode_jpeg([b[1] for b in batch], mode=ImageReadMode.RGB, device=device)
        except Exception:
            decoded = []
            for n, (i, raw, _) in enumerate(batch):
                try:
                    arr = decode_image(datas[i], max_image_bytes, max_pixels)
                    decoded.append(torch.from_numpy(arr).to(device).permute(2, 0, 1))
                except ImageError as exc:
                    decoded.append(exc)
                batch[n] = (i, raw, 1)  # decode_image already applied the EXIF orientation
        for (i, _, orientation), chw in zip(batch, decoded, strict=False):
            if isinstance(chw, ImageError):
                results[i] = chw
            else:
                hwc = chw.permute(1, 2, 0)  # [H, W, 3]
                results[i] = apply_orientation(hwc, orientation).contiguous()
    return results
