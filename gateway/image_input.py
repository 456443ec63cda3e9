"""Image input at the gateway edge: data URLs, references to known images, and a cheap sniff.

The sniff reads only the image header (format and size) so a bad or oversized image is refused
at once, before the item is added to the conversation; full decoding happens in the encoder,
which applies the same limits again.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import re
import warnings
from collections.abc import Iterable, Mapping

from gateway.protocol.errors import GatewayError

__all__ = ("REF_PREFIX", "ImageBytes", "ImageRef", "digest_of", "fetch_remote_images", "parse_image_url",
           "sniff_image")

REF_PREFIX = "visiongate:sha256:"
ALLOWED_FORMATS = frozenset(("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"))
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.ASCII)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ImageRef(str):
    """A digest of an image already uploaded or seen (`visiongate:sha256:<hex>`)."""


class ImageBytes(bytes):
    """Raw bytes of an image sent inline."""


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_image_url(url: str, *, max_bytes: int, param: str = "image_url",
                    fetched: Mapping[str, bytes] | None = None) -> ImageBytes | ImageRef:
    """A data URL -> its bytes; a `visiongate:sha256:<hex>` reference -> the digest.

    Remote (http/https) URLs are refused unless `fetched` holds their bytes (see
    `fetch_remote_images`, which fetches only what the configured allow-list admits).
    """
    if url.startswith(REF_PREFIX):
        digest = url[len(REF_PREFIX):].lower()
        if not _HEX64.match(digest):
            raise GatewayError("invalid_image", f"{REF_PREFIX} must be followed by 64 hex digits",
                               param=param)
        return ImageRef(digest)
    if url.startswith(("http://", "https://")):
        if fetched is not None and url in fetched:
            return ImageBytes(fetched[url])
        raise GatewayError("invalid_image", "remote image URLs are not fetched; send the image as "
                           "a data URL (data:image/jpeg;base64,...) or upload it first", param=param)
    match = _DATA_URL.match(url)
    if match is None:
        raise GatewayError("invalid_image", "image_url must be a data URL "
                           "(data:image/<type>;base64,...) or visiongate:sha256:<hex>", param=param)
    if match.group("b64") is None:
        raise GatewayError("invalid_image", "image data URLs must be base64-encoded", param=param)
    mime = (match.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise GatewayError("unsupported_image_format", f"data URL media type {mime!r} is not an image",
                           param=param)
    payload = url[match.end():]
    # base64 inflates by 4/3: refuse before decoding what is certainly too large
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise GatewayError("image_too_large",
                           f"image is about {len(payload) * 3 // 4} bytes; the limit is {max_bytes}",
                           param=param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise GatewayError("invalid_image", "image data URL is not valid base64", param=param) from None
    if len(data) > max_bytes:
        raise GatewayError("image_too_large", f"image is {len(data)} bytes; the limit is {max_bytes}",
                           param=param)
    if not data:
        raise GatewayError("invalid_image", "image data URL is empty", param=param)
    return ImageBytes(data)


def sniff_image(data: bytes, *, max_bytes: int, max_pixels: int, param: str = "image_url") -> tuple[str, int, int]:
    """(format, width, height) from the header only; GatewayError for anything unusable."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > max_bytes:
        raise GatewayError("image_too_large", f"image is {len(data)} bytes; the limit is {max_bytes}",
                           param=param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                fmt, (width, height) = img.format or "", img.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise GatewayError("image_too_large", "image dimensions exceed the decompression-bomb limit",
                           param=param) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise GatewayError("invalid_image", "bytes are not a readable image", param=param) from None
    if fmt not in ALLOWED_FORMATS:
        raise GatewayError("unsupported_image_format",
                           f"image format {fmt or 'unknown'} is not supported; use "
                           f"{', '.join(sorted(ALLOWED_FORMATS))}", param=param)
    if width * height > max_pixels:
        raise GatewayError("image_too_large",
                           f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}",
                           param=param)
    if width < 1 or height < 1:
        raise GatewayError("invalid_image", "image has no pixels", param=param)
    return fmt, width, height


def _allowed(url: str, allowlist: Iterable[str]) -> bool:
    return any(url.startswith(prefix) for prefix in allowlist)


async def fetch_remote_images(urls: Iterable[str], *, allowlist: Iterable[str], max_bytes: int,
                              timeout_s: float = 10.0) -> dict[str, bytes]:
    """Bytes of the http(s) image URLs that start with an allow-listed prefix.

    URLs off the list are skipped (parse_image_url then refuses them). Redirects are not
    followed (they could leave the allow-list), bodies stop at `max_bytes`, and any failure is
    GatewayError(image_fetch_failed) naming the URL. With an empty allow-list nothing is fetched.
    """
    allowlist = tuple(allowlist)
    wanted = list(dict.fromkeys(u for u in urls if u.startswith(("http://", "https://"))
                                and _allowed(u, allowlist)))
    if not wanted:
        return {}
    out: dict[str, bytes] = {}
    try:
        # one deadline for the lot: a host that drips bytes cannot hold the caller
        async with asyncio.timeout(timeout_s * 2):
            await _fetch_all(wanted, out, max_bytes, timeout_s)
    except TimeoutError:
        raise GatewayError("image_fetch_failed", f"fetching {len(wanted)} image(s) took over "
                           f"{timeout_s * 2:.0f} s", param="image_url") from None
    return out


async def _fetch_all(wanted: list[str], out: dict[str, bytes], max_bytes: int, timeout_s: float) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=False) as client:
        for url in wanted:
            try:
                async with client.stream("GET", url) as response:
                    if response.status_code != 200:
                        raise GatewayError("image_fetch_failed",
                                           f"{url} answered HTTP {response.status_code}", param="image_url")
                    kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
                    if kind and not kind.startswith("image/"):
                        raise GatewayError("unsupported_image_format",
                                           f"{url} is {kind}, not an image", param="image_url")
                    body = bytearray()
                    async for chunk in response.aiter_bytes():
                        body += chunk
                        if len(body) > max_bytes:
                            raise GatewayError("image_too_large", f"{url} is over the {max_bytes}-byte "
                                               "image limit", param="image_url")
            except httpx.HTTPError as exc:
                raise GatewayError("image_fetch_failed", f"fetching {url} failed: {type(exc).__name__}",
                                   param="image_url") from None
            out[url] = bytes(body)
