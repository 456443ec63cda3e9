"""A bound on how much memory decoding a JSON body may take, checked before it is decoded.

Body size limits leave room for images sent inline (a chat request may resend a session's
images, hundreds of MiB of base64), and base64 is one long string: cheap to decode. The same
number of bytes spent on tiny values is not: `[{}, {}, ...]` or `["", "", ...]` decodes to
tens of bytes of Python objects per byte of JSON, gigabytes for one request, on the event
loop. So every JSON body's values are counted first (commas, objects and arrays, with
`bytes.count`, at memory speed) and a body with more than `MAX_JSON_VALUES` is refused with
`request_too_large`. Real requests stay far below it: a million-character conversation has
some tens of thousands of commas, and 128 tools with their schemas a few thousand objects.
"""

from __future__ import annotations

from typing import Any

from litestar import Request

from gateway.protocol.errors import GatewayError

__all__ = ("MAX_JSON_VALUES", "BoundedRequest", "check_json_values")

MAX_JSON_VALUES = 500_000


def check_json_values(body: bytes, limit: int = MAX_JSON_VALUES) -> None:
    """Refuse a JSON body with more than `limit` values (an upper bound: separators in
    strings count too, which only makes the bound safer)."""
    if len(body) <= limit:  # fewer bytes than the limit: fewer values too
        return
    values = body.count(b",") + body.count(b"{") + body.count(b"[")
    if values > limit:
        raise GatewayError(
            "request_too_large",
            f"the body holds about {values} JSON values; at most {limit}: send images by "
            "reference or upload, and split very long inputs",
        )


class BoundedRequest(Request[Any, Any, Any]):
    """Litestar's request, with JSON bodies checked by `check_json_values` when first read
    (data decoding and handlers reading the body both come through here)."""

    _checked = False

    async def body(self) -> bytes:
        body = await super().body()
        if not self._checked:
            self._checked = True
            if "json" in self.headers.get("content-type", "json"):
                check_json_values(body)
        return body
