"""Remote image URLs: normalised, checked against an allow-list, fetched with bounds.

A remote URL is normalised before the allow-list sees it (`normalise_url`): the allow-list
compares scheme, host, port and a path prefix ending on a segment boundary, never raw string
prefixes, and it is checked again on every redirect target and on the URL actually sent.
`fetch_remote_images` fetches only what the configured allow-list admits, each image within
the byte limit, and hands the bytes to `image_input.parse_image_url`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple
from urllib.parse import quote, urljoin, urlsplit

from gateway.protocol.errors import GatewayError, clip

__all__ = (
    "MAX_URL_CHARS",
    "RemoteURL",
    "fetch_remote_images",
    "is_remote",
    "normalise_url",
    "url_allowed",
)

_DEFAULT_PORTS = {"http": 80, "https": 443}
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_SUB_DELIMS = "!$&'()*+,;="
_HOST = re.compile(r"^[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*$")
_HEX = frozenset("0123456789abcdefABCDEF")
# escapes an origin may decode into a separator or a dot after we have looked: an encoded slash
# or backslash, a NUL, and double-encoded dots, slashes and backslashes
_AMBIGUOUS_ESCAPES = re.compile(r"%(?:2F|5C|00|25(?:2E|2F|5C|00))", re.IGNORECASE)
MAX_URL_CHARS = 8192


def is_remote(url: str) -> bool:
    """Whether an image URL is an http(s) one (fetched only under the allow-list)."""
    return url[:8].lower().startswith(("http://", "https://"))


class RemoteURL(NamedTuple):
    """A normalised http(s) URL: lower-case scheme and host, the port always set, the path with
    unreserved characters decoded, escapes in upper case, no dot segments; no user info, no
    fragment. `str()` is the URL that is fetched."""

    scheme: str
    host: str  # an IPv6 address in brackets
    port: int
    path: str  # starts with "/"
    query: str  # "" when there is none

    def __str__(self) -> str:
        port = "" if _DEFAULT_PORTS[self.scheme] == self.port else f":{self.port}"
        query = f"?{self.query}" if self.query else ""
        return f"{self.scheme}://{self.host}{port}{self.path}{query}"


class _Unsafe(ValueError):
    """A URL that is malformed or could be read differently by the origin (the reason)."""


def _normalise_chars(text: str, safe: str) -> str:
    """Decode escapes of unreserved characters, upper-case the others, percent-encode (as
    UTF-8) every character that is neither unreserved nor in `safe`."""
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "%":
            pair = text[i + 1 : i + 3]
            if len(pair) != 2 or not set(pair) <= _HEX:
                raise _Unsafe("has a malformed percent-escape")
            decoded = chr(int(pair, 16))
            out.append(decoded if decoded in _UNRESERVED else f"%{pair.upper()}")
            i += 3
            continue
        out.append(ch if ch in _UNRESERVED or ch in safe else quote(ch, safe=""))
        i += 1
    return "".join(out)


def _normalise_path(path: str) -> str:
    segments = [_normalise_chars(seg, _SUB_DELIMS + ":@") for seg in path.split("/")[1:]]
    for seg in segments:
        if _AMBIGUOUS_ESCAPES.search(seg):
            raise _Unsafe("has an encoded slash, backslash or NUL, or a double-encoded one")
        base = seg.split(";", 1)[0]
        if base in (".", "..") and base != seg:
            raise _Unsafe("has a dot segment with parameters (`..;`)")
    dotted = any(seg in (".", "..") for seg in segments)
    if dotted and "" in segments[:-1]:
        raise _Unsafe("mixes empty and dot segments, which servers resolve differently")
    out: list[str] = []
    for seg in segments:
        if seg == ".":
            continue
        if seg == "..":
            if not out:
                raise _Unsafe("climbs above the root with `..`")
            out.pop()
            continue
        out.append(seg)
    if segments and segments[-1] in (".", ".."):
        out.append("")  # `/a/b/..` is the directory `/a/`
    return "/" + "/".join(out)


def normalise_url(url: str) -> RemoteURL:
    """`url` (http or https) normalised; ValueError (its message says why) for a URL that is
    malformed, carries user info, or could be read differently by the origin (encoded slashes
    or backslashes, `..` above the root, whitespace or control characters, ...)."""
    if len(url) > MAX_URL_CHARS:
        raise _Unsafe(f"is longer than {MAX_URL_CHARS} characters")
    if any(ch <= " " or ch == "\x7f" or ch == "\\" for ch in url):
        raise _Unsafe("has whitespace, a control character or a backslash")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise _Unsafe("has an invalid host or port") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise _Unsafe("is not http or https")
    if "@" in parts.netloc:
        raise _Unsafe("has user info (`user@`), which image URLs may not carry")
    host = (parts.hostname or "").lower()
    if parts.netloc.startswith("["):
        try:
            host = f"[{ipaddress.IPv6Address(host).compressed}]"
        except ValueError:
            raise _Unsafe("has an invalid IPv6 host") from None
    else:
        host = host.removesuffix(".")
        if not _HOST.match(host):
            raise _Unsafe("has an invalid host (use ASCII or punycode names)")
    if port == 0:
        raise _Unsafe("has an invalid host or port")
    path = _normalise_path(parts.path or "/")
    query = _normalise_chars(parts.query, _SUB_DELIMS + ":@/?")
    return RemoteURL(scheme, host, port or _DEFAULT_PORTS[scheme], path, query)


def _allow_entries(allowlist: Iterable[str]) -> list[RemoteURL]:
    entries = []
    for prefix in allowlist:
        try:
            entries.append(normalise_url(prefix))
        except ValueError:
            continue  # Settings refuses malformed entries; an odd one admits nothing
    return entries


def _under(path: str, prefix: str) -> bool:
    if prefix.endswith("/"):
        return path.startswith(prefix)
    return path == prefix or path.startswith(prefix + "/")


def url_allowed(url: RemoteURL, allowlist: Iterable[RemoteURL]) -> bool:
    """Whether `url` is under one of the entries: same scheme, host and port, and a path at or
    below the entry's path on a segment boundary (`/img` admits `/img/a.png`, not `/imgs/`)."""
    return any(
        url.scheme == e.scheme
        and url.host == e.host
        and url.port == e.port
        and _under(url.path, e.path)
        for e in allowlist
    )


async def fetch_remote_images(
    urls: Iterable[str],
    *,
    allowlist: Iterable[str],
    max_bytes: int,
    timeout_s: float = 10.0,
    max_redirects: int = 5,
) -> dict[str, bytes]:
    """Bytes of the http(s) image URLs the allow-list admits, keyed by the URL as given.

    URLs off the list are skipped (parse_image_url then refuses them); a URL that is malformed
    or ambiguous is GatewayError(invalid_request). Redirects are followed only to allow-listed
    URLs (at most `max_redirects`), bodies stop at `max_bytes`, and any failure is
    GatewayError(image_fetch_failed) naming the URL. With an empty allow-list nothing is fetched.
    """
    entries = _allow_entries(allowlist)
    if not entries:
        return {}
    wanted: dict[str, RemoteURL] = {}
    for url in urls:
        if url in wanted or not is_remote(url):
            continue
        try:
            normal = normalise_url(url)
        except ValueError as exc:
            raise GatewayError(
                "invalid_request", f"image URL {clip(url)} {exc}", param="image_url"
            ) from None
        if url_allowed(normal, entries):
            wanted[url] = normal
    if not wanted:
        return {}
    out: dict[str, bytes] = {}
    try:
        # one deadline for the lot: a host that drips bytes cannot hold the caller
        async with asyncio.timeout(timeout_s * 2):
            await _fetch_all(wanted, out, entries, max_bytes, timeout_s, max_redirects)
    except TimeoutError:
        raise GatewayError(
            "image_fetch_failed",
            f"fetching {len(wanted)} image(s) took over {timeout_s * 2:.0f} s",
            param="image_url",
        ) from None
    return out


_REDIRECTS = frozenset((301, 302, 303, 307, 308))


async def _fetch_all(
    wanted: Mapping[str, RemoteURL],
    out: dict[str, bytes],
    entries: list[RemoteURL],
    max_bytes: int,
    timeout_s: float,
    max_redirects: int,
) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=False) as client:
        for url, target in wanted.items():
            shown = clip(url)
            try:
                out[url] = await _fetch_one(
                    client, shown, target, entries, max_bytes, max_redirects
                )
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                raise GatewayError(
                    "image_fetch_failed",
                    f"fetching {shown} failed: {type(exc).__name__}",
                    param="image_url",
                ) from None


async def _fetch_one(
    client,
    shown: str,
    target: RemoteURL,
    entries: list[RemoteURL],
    max_bytes: int,
    max_redirects: int,
) -> bytes:
    for _ in range(max_redirects + 1):
        request = client.build_request("GET", str(target))
        # the URL actually sent, as the HTTP client encoded it, must be allowed too
        try:
            sent = normalise_url(str(request.url))
        except ValueError:
            sent = None
        if sent is None or not url_allowed(sent, entries):
            raise GatewayError(
                "image_fetch_failed",
                f"{shown} is not on the image allow-list once encoded for sending",
                param="image_url",
            )
        response = await client.send(request, stream=True)
        try:
            if response.status_code in _REDIRECTS and "location" in response.headers:
                try:
                    target = normalise_url(urljoin(str(sent), response.headers["location"]))
                except ValueError:
                    target = None
                if target is None or not url_allowed(target, entries):
                    raise GatewayError(
                        "image_fetch_failed",
                        f"{shown} redirects to a URL off the image allow-list",
                        param="image_url",
                    )
                continue
            return await _read_image(response, shown, max_bytes)
        finally:
            await response.aclose()
    raise GatewayError(
        "image_fetch_failed",
        f"{shown} redirects more than {max_redirects} times",
        param="image_url",
    )


async def _read_image(response, shown: str, max_bytes: int) -> bytes:
    if response.status_code != 200:
        raise GatewayError(
            "image_fetch_failed", f"{shown} answered HTTP {response.status_code}", param="image_url"
        )
    kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind and not kind.startswith("image/"):
        raise GatewayError(
            "unsupported_image_format",
            f"{shown} is {clip(kind, 80)}, not an image",
            param="image_url",
        )
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > max_bytes:
            raise GatewayError(
                "image_too_large",
                f"{shown} is over the {max_bytes}-byte image limit",
                param="image_url",
            )
    return bytes(body)
