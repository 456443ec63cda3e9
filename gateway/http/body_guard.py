"""Large bodies from an API key whose requests keep being refused are no longer read.

A request body is read and decoded before the gateway can tell what is wrong with its parts
(an inline image over `max_image_bytes`, a text over `max_text_chars`, a bad field): a 28 MB
chat body costs the event loop about 150 ms of CPU before its `image_too_large`, time every
other key's streams wait for. One key sending such bodies in a loop slows every other key.

The gateway keeps, per API key, the body bytes it read for requests it then refused (a 4xx but
401 and 429, `gateway.ratelimit.counts_as_refused`) over the last minute (`RefusedBytes`, on
the gateway state, shared with the WebSocket's frames). `BodyGuard` (pure ASGI, inside the
request-id middleware) counts them, and once a key's total reaches
`max_refused_body_bytes_per_minute` answers its requests whose body is over `SMALL_BODY` (or of
unknown length) from the headers alone: 429 `rate_limited` with `Retry-After`, the time until
the total falls below the limit again. A body of known length up to `DRAIN_LIMIT` is read and
dropped first (no decoding or copying: about a tenth of the cost of serving it), so the client,
which sends its whole body before it reads, gets the answer on a connection it can reuse; a
longer or chunked one is never read, and the answer goes out with `Connection: close`. Small
bodies, GETs and other keys pass as before: the key can still chat and learn what it did
wrong, and a request answered this way adds nothing to the total, so a client that waits is
served again.

With no API keys configured every caller is one owner, and one caller's mistakes would refuse
everyone's large bodies: the guard is then off. The totals are per gateway replica.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from gateway.http.protocol import error_response
from gateway.protocol.errors import GatewayError
from gateway.ratelimit import SMALL_BODY, counts_as_refused, refused_error

if TYPE_CHECKING:
    from litestar.types import ASGIApp, Message, Receive, Scope, Send

    from gateway.ratelimit import RefusedBytes
    from gateway.state import GatewayState

__all__ = ("DRAIN_LIMIT", "BodyGuard")

log = structlog.get_logger(__name__)

DRAIN_LIMIT = 64 * 1024 * 1024  # a refused body up to this size is read (and dropped) first
_encode = msgspec.json.Encoder().encode


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _body_length(scope: Scope) -> int | None:
    """The declared body length; None when unknown (chunked, or a bad header)."""
    value = _header(scope, b"content-length")
    if value is None:
        return None if _header(scope, b"transfer-encoding") else 0
    try:
        length = int(value.strip())
    except ValueError:
        return None
    return length if length >= 0 else None


class BodyGuard:
    """Pure ASGI: see the module."""

    __slots__ = ("app", "state")

    def __init__(self, app: ASGIApp, state: GatewayState) -> None:
        self.app = app
        self.state = state

    @property
    def refused(self) -> RefusedBytes:
        return self.state.refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.refused.limit <= 0:
            await self.app(scope, receive, send)
            return
        length = _body_length(scope)
        if length is not None and length <= SMALL_BODY:
            await self.app(scope, receive, send)
            return
        headers = {"authorization": _header(scope, b"authorization") or ""}
        try:
            owner = self.state.auth.owner(headers)
        except GatewayError:  # the app answers 401
            await self.app(scope, receive, send)
            return
        retry = self.refused.retry_after(owner)
        if retry is not None:
            await self._refuse(receive, send, length, retry)
            return
        read = 0
        status = 0

        async def counting_receive() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
            return message

        async def watching_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        finally:
            if counts_as_refused(status):
                self.refused.add(owner, read)

    async def _refuse(
        self, receive: Receive, send: Send, length: int | None, retry_s: float
    ) -> None:
        """Answer 429 without decoding the body (see the module): drained first when its
        length is known and at most `DRAIN_LIMIT`, else left unread and the connection closed
        (the client may then see a reset before it reads the answer)."""
        drained = length is not None and length <= DRAIN_LIMIT
        if drained:
            while True:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
        error = error_response(refused_error(self.refused.limit, retry_s))
        body = _encode({"error": error.error})
        self.state.metrics.record_error(code="rate_limited", api="http")
        log.info("client_error", api="http", code="rate_limited", reason="refused_bytes")
        headers: list[Any] = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(error.retry_after).encode()),
        ]
        if not drained:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": body})
