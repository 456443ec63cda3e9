"""Large bodies from an API key whose requests keep being refused are no longer read.

A request body is read and decoded before the gateway can tell what is wrong with its parts
(an inline image over `max_image_bytes`, a text over `max_text_chars`, a bad field): a 28 MB
chat body costs the event loop about 150 ms of CPU before its `image_too_large`, time every
other key's streams wait for. One key sending such bodies in a loop slows every other key.

The gateway keeps, per API key, the bytes of the bodies over `SMALL_BODY` it read for requests
it then refused (a 4xx but 401 and 429, `gateway.ratelimit.counts_as_refused`) over the last
minute (`RefusedBytes`, on the gateway state; large WebSocket frames count the same way).
`BodyGuard` (pure ASGI, inside the request-id middleware) counts them, recording a refusal as
its answer starts; and once a key's total reaches `max_refused_body_bytes_per_minute` it
answers that key's bodies over `SMALL_BODY` (or of unknown length: chunked, or a
Content-Length beside chunked framing) from the headers alone: 429 `rate_limited` with
`Retry-After`, the whole seconds until the total falls below the limit again. While a key has
refusals on record its large bodies are read one at a time, so a burst is counted body by body
rather than all read before the first refusal lands. A large body without a valid key is
answered 401 the same way: it could never be served.

Such an answer reads nothing into memory: a body of known length up to `DRAIN_LIMIT` is
drained first (about a tenth of the cost of decoding it), so the client, which sends its whole
body before it reads, gets the answer on a connection it can reuse; a longer or chunked one, or
one whose client waits for `100 Continue`, is never read, and the answer goes out with
`Connection: close`. Small bodies, GETs and other keys pass as before: the key can still chat
and learn what it did wrong, and an answer given this way adds nothing to the total, so a
client that waits is served again.

With no API keys configured every caller is one owner, and one caller's mistakes would refuse
everyone's large bodies: the guard is then off. The totals are per gateway replica.
"""

from __future__ import annotations

import asyncio
import math
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
    """The declared body length; None when unknown: chunked (HTTP/1.1 frames a body by its
    Transfer-Encoding whatever Content-Length says), a repeated or malformed Content-Length."""
    lengths = []
    for key, value in scope.get("headers", ()):
        name = key.lower()
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            lengths.append(value)
    if not lengths:
        return 0
    if len(lengths) > 1:
        return None
    try:
        length = int(lengths[0].strip())
    except ValueError:
        return None
    return length if length >= 0 else None


class _Turns:
    """Per owner, one large body read at a time (while the owner has refusals on record), so
    a burst of concurrent bodies is counted one by one instead of all read before the first
    refusal lands."""

    __slots__ = ("_locks",)

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # owner -> (lock, users)

    async def acquire(self, owner: str) -> asyncio.Lock:
        lock, users = self._locks.setdefault(owner, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            await lock.acquire()
        except BaseException:
            self._leave(owner, users)
            raise
        return lock

    def release(self, owner: str, lock: asyncio.Lock) -> None:
        lock.release()
        entry = self._locks.get(owner)
        if entry is not None:
            self._leave(owner, entry[1])

    def _leave(self, owner: str, users: list[int]) -> None:
        users[0] -= 1
        if users[0] <= 0:
            self._locks.pop(owner, None)


class BodyGuard:
    """Pure ASGI: see the module."""

    __slots__ = ("_turns", "app", "state")

    def __init__(self, app: ASGIApp, state: GatewayState) -> None:
        self.app = app
        self.state = state
        self._turns = _Turns()

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
        try:
            owner = self.state.auth.owner({"authorization": _header(scope, b"authorization") or ""})
        except GatewayError as exc:  # never served: not worth decoding either
            await self._answer(scope, receive, send, length, exc)
            return
        refused = self.refused
        turn: asyncio.Lock | None = None
        if refused.total(owner) > 0:
            turn = await self._turns.acquire(owner)
        try:
            retry = refused.retry_after(owner)
            if retry is not None:
                await self._answer(
                    scope, receive, send, length, refused_error(refused.limit, retry)
                )
                return
            await self._serve(scope, receive, send, owner, turn)
            turn = None  # released by _serve
        finally:
            if turn is not None:
                self._turns.release(owner, turn)

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, owner: str, turn: asyncio.Lock | None
    ) -> None:
        """Run the app, counting the body's bytes; a refusal is recorded (and the owner's turn
        passed on) as soon as its answer starts, before the client reads it."""
        read = 0
        recorded = False

        def settle(status: int) -> None:
            nonlocal recorded, turn
            if not recorded:
                recorded = True
                if counts_as_refused(status):
                    self.refused.add(owner, read)
            if turn is not None:
                self._turns.release(owner, turn)
                turn = None

        async def counting_receive() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
            return message

        async def watching_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                settle(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        finally:
            settle(0)

    async def _answer(
        self, scope: Scope, receive: Receive, send: Send, length: int | None, exc: GatewayError
    ) -> None:
        """Answer `exc` without decoding the body: drained first when its length is known and
        at most `DRAIN_LIMIT` (and the client does not wait for `100 Continue` before sending
        it), else left unread and the connection closed (the client may then see a reset
        before it reads the answer)."""
        expects = (_header(scope, b"expect") or "").lower() == "100-continue"
        drained = length is not None and length <= DRAIN_LIMIT and not expects
        if drained:
            while True:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
        error = error_response(exc)
        body = _encode({"error": error.error})
        self.state.metrics.record_error(code=exc.code, api="http")
        log.info("client_error", api="http", code=exc.code, reason="body_not_read")
        headers: list[Any] = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        if exc.retry_after_s is not None:
            headers.append((b"retry-after", str(max(math.ceil(exc.retry_after_s), 1)).encode()))
        if not drained:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": exc.http_status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
