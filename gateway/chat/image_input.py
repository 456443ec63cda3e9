"""Image input at the gateway edge: data URLs, references to known images, remote URLs under
an allow-list, and a cheap sniff.

The sniff reads only the image header (format and size) so a bad or oversized image is refused
at once, before the item is added to the conversation; full decoding happens in the encoder,
which applies the same limits again. Both accept the same formats: the encoder's
`ALLOWED_FORMATS`, the one definition.

Remote URLs, their allow-list and their fetching are `remote_images`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from collections.abc import Mapping

from encoder_worker.decode import ALLOWED_FORMATS
from gateway.chat.remote_images import is_remote
from gateway.protocol.errors import GatewayError, clip

__all__ = (
    "ALLOWED_FORMATS",
    "REF_PREFIX",
    "ImageBytes",
    "ImageRef",
    "digest_of",
    "media_type",
    "parse_image_url",
    "sniff_image",
)

REF_PREFIX = "visiongate:sha256:"
_DATA_URL = re.compile(
    r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
    re.ASCII,
)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ImageRef(str):
    """A digest of an image already uploaded or seen (`visiongate:sha256:<hex>`)."""


class ImageBytes(bytes):
    """Raw bytes of an image sent inline."""


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# leading bytes of each of ALLOWED_FORMATS -> its media type
_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)


def media_type(data: bytes) -> str:
    """The media type of an image that passed `sniff_image`, from its signature (a data URL
    sent on names it); "application/octet-stream" for anything else."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    for signature, kind in _SIGNATURES:
        if data.startswith(signature):
            return kind
    return "application/octet-stream"


def parse_image_url(
    url: str,
    *,
    max_bytes: int,
    param: str = "image_url",
    fetched: Mapping[str, bytes] | None = None,
) -> ImageBytes | ImageRef:
    """A data URL -> its bytes; a `visiongate:sha256:<hex>` reference -> the digest.

    Remote (http/https) URLs are refused unless `fetched` holds their bytes (see
    `fetch_remote_images`, which fetches only what the configured allow-list admits).
    """
    if url.startswith(REF_PREFIX):
        digest = url[len(REF_PREFIX) :].lower()
        if not _HEX64.match(digest):
            raise GatewayError(
                "invalid_image", f"{REF_PREFIX} must be followed by 64 hex digits", param=param
            )
        return ImageRef(digest)
    if is_remote(url):
        if fetched is not None and url in fetched:
            return ImageBytes(fetched[url])
        raise GatewayError(
            "invalid_image",
            "remote image URLs are not fetched; send the image as "
            "a data URL (data:image/jpeg;base64,...) or upload it first",
            param=param,
        )
    match = _DATA_URL.match(url)
    if match is None:
        raise GatewayError(
            "invalid_image",
            "image_url must be a data URL "
            "(data:image/<type>;base64,...) or visiongate:sha256:<hex>",
            param=param,
        )
    if match.group("b64") is None:
        raise GatewayError("invalid_image", "image data URLs must be base64-encoded", param=param)
    mime = (match.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise GatewayError(
            "unsupported_image_format",
            f"data URL media type {clip(mime)!r} is not an image",
            param=param,
        )
    payload = url[match.end() :]
    # base64 inflates by 4/3: refuse before decoding what is certainly too large
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise GatewayError(
            "image_too_large",
            f"image is about {len(payload) * 3 // 4} bytes; the limit is {max_bytes}",
            param=param,
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise GatewayError(
            "invalid_image", "image data URL is not valid base64", param=param
        ) from None
    if len(data) > max_bytes:
        raise GatewayError(
            "image_too_large", f"image is {len(data)} bytes; the limit is {max_bytes}", param=param
        )
    if not data:
        raise GatewayError("invalid_image", "image data URL is empty", param=param)
    return ImageBytes(data)


def sniff_image(
    data: bytes, *, max_bytes: int, max_pixels: int, param: str = "image_url"
) -> tuple[str, int, int]:
    """(format, width, height) from the header only; GatewayError for anything unusable.

    Opens the bytes the way the encoder does (only `ALLOWED_FORMATS`), so what passes here
    decodes there; a format Pillow recognises but the encoder does not decode (TIFF, PSD, ...)
    is `unsupported_image_format`."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > max_bytes:
        raise GatewayError(
            "image_too_large", f"image is {len(data)} bytes; the limit is {max_bytes}", param=param
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS) as img:
                fmt, (width, height) = img.format or "", img.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise GatewayError(
            "image_too_large", "image dimensions exceed the decompression-bomb limit", param=param
        ) from None
    except UnidentifiedImageError:
        other = _other_format(data)
        if other is not None:
            raise GatewayError(
                "unsupported_image_format",
                f"{other} images are not supported; use {', '.join(sorted(ALLOWED_FORMATS))}",
                param=param,
            ) from None
        raise GatewayError("invalid_image", "bytes are not a readable image", param=param) from None
    except Exception:  # a plugin failing on odd bytes (struct.error, ...): not an image
        raise GatewayError("invalid_image", "bytes are not a readable image", param=param) from None
    if width * height > max_pixels:
        raise GatewayError(
            "image_too_large",
            f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}",
            param=param,
        )
    if width < 1 or height < 1:
        raise GatewayError("invalid_image", "image has no pixels", param=param)
    return fmt, width, height


def _other_format(data: bytes) -> str | None:
    """The name of a format outside ALLOWED_FORMATS whose signature `data` starts with (the
    plugins' magic-number checks only: nothing is parsed), or None. Bytes that start like an
    allowed format are a damaged image of that format, not another format."""
    from PIL import Image

    Image.init()
    prefix = data[:16]
    matches = [fmt for fmt, (_, accept) in Image.OPEN.items() if _accepts(accept, prefix)]
    if any(fmt in ALLOWED_FORMATS for fmt in matches):
        return None
    return matches[0] if matches else None


def _accepts(accept, prefix: bytes) -> bool:
    try:
        return bool(accept and accept(prefix))
    except Exception:  # some checks unpack more bytes than a tiny input has
        return False
