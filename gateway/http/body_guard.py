"""Large bodies from an API key whose large bodies keep being refused are no longer read.

A request body is read and decoded before the gateway can tell that it is too large in its
parts (an inline image over `max_image_bytes`, a text over `max_text_chars`): a 28 MB chat body
costs the event loop about 150 ms of CPU before its `image_too_large`, time every other key's
streams wait for. One key sending such bodies in a loop slows every other key's answers.

`BodyGuard` (pure ASGI, inside the request-id middleware) remembers, per API key, the body bytes
it read for requests that were then refused as too large (HTTP 413: `image_too_large`,
`input_too_large`, `request_too_large`) over the last minute (`RefusedBytes`). Once a key's
total reaches `max_refused_body_bytes_per_minute`, its requests whose body is over
`SMALL_BODY` (or of unknown length) are answered at once, from the headers alone, with 429
`rate_limited`, `Retry-After` (when the total will have fallen below the limit again) and
`Connection: close` (the body is never read, so the connection cannot be reused). Small bodies,
GETs and WebSockets pass as before: the key can still chat and learn what it did wrong. A
refused-at-once request adds nothing to the total, so a client that waits is served again.

With no API keys configured every caller is one owner, and one caller's mistakes would refuse
everyone's large bodies: the guard is then off. The totals are per gateway replica.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from gateway.http.protocol import error_response
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from litestar.types import ASGIApp, Message, Receive, Scope, Send

    from gateway.state import GatewayState

__all__ = ("SMALL_BODY", "WINDOW_S", "BodyGuard", "RefusedBytes")

log = structlog.get_logger(__name__)

SMALL_BODY = 1024 * 1024  # bodies up to this size are always read
DRAIN_LIMIT = 64 * 1024 * 1024  # a refused body up to this size is read (and dropped) first
WINDOW_S = 60.0
_TOO_LARGE = 413
_encode = msgspec.json.Encoder().encode


class RefusedBytes:
    """Per owner, the body bytes of refused-as-too-large requests over the last `window_s`."""

    __slots__ = ("_clock", "_owners", "limit", "window_s")

    def __init__(
        self, limit: int, *, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._owners: dict[str, tuple[deque[tuple[float, int]], list[int]]] = {}

    def _expire(self, owner: str, now: float) -> tuple[deque[tuple[float, int]], list[int]] | None:
        entry = self._owners.get(owner)
        if entry is None:
            return None
        events, total = entry
        while events and events[0][0] <= now - self.window_s:
            total[0] -= events.popleft()[1]
        if not events:
            del self._owners[owner]
            return None
        return entry

    def add(self, owner: str, nbytes: int) -> None:
        if nbytes <= 0:
            return
        now = self._clock()
        entry = self._expire(owner, now) or self._owners.setdefault(owner, (deque(), [0]))
        events, total = entry
        events.append((now, nbytes))
        total[0] += nbytes

    def total(self, owner: str) -> int:
        entry = self._expire(owner, self._clock())
        return entry[1][0] if entry is not None else 0

    def retry_after(self, owner: str) -> float | None:
        """Seconds until `owner`'s total falls below the limit; None while it is below."""
        if self.limit <= 0:
            return None
        now = self._clock()
        entry = self._expire(owner, now)
        if entry is None or entry[1][0] < self.limit:
            return None
        events, total = entry
        left = total[0]
        for at, nbytes in events:
            left -= nbytes
            if left < self.limit:
                return max(at + self.window_s - now, 0.0)
        return self.window_s  # unreachable: the last event takes the total to 0


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

    __slots__ = ("app", "refused", "state")

    def __init__(self, app: ASGIApp, state: GatewayState, refused: RefusedBytes) -> None:
        self.app = app
        self.state = state
        self.refused = refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.refused.limit <= 0 or not self.state.auth.enabled:
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
            if status == _TOO_LARGE:
                self.refused.add(owner, read)

    async def _refuse(
        self, receive: Receive, send: Send, length: int | None, retry_s: float
    ) -> None:
        """Answer 429. A body of known length up to `DRAIN_LIMIT` is read and dropped first (no
        decoding, no copies), so the client, which sends its whole body before it reads, gets
        the answer on a connection it can reuse; a longer or chunked one is never read: the
        answer goes out with `Connection: close` and the client may see the connection reset
        before it reads the answer."""
        drained = length is not None and length <= DRAIN_LIMIT
        if drained:
            while True:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
        limit_mib = self.refused.limit / (1024 * 1024)
        error = error_response(
            GatewayError(
                "rate_limited",
                f"this API key's requests refused as too large reached {limit_mib:g} MiB in "
                f"the last minute; its bodies over {SMALL_BODY // 1024} KiB are not read "
                f"for {retry_s:.0f} s",
                retry_after_s=retry_s,
            )
        )
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
