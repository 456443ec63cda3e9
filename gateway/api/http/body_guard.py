"""Large bodies from an API key whose requests keep being refused are no longer read.

A request body is read and decoded before the gateway can tell what is wrong with its parts
(an inline image over `max_image_bytes`, a text over `max_text_chars`, a bad field): a 28 MB
chat body costs the event loop 120 to 150 ms of CPU before its `image_too_large`, time every
other key's streams wait for. One key sending such bodies in a loop slows every other key.

The gateway keeps, per API key, the bytes of the bodies over `SMALL_BODY` it read for requests
it then refused (a 4xx but 401 and 429, `gateway.policy.ratelimit.counts_as_refused`) over the last
minute (`RefusedBytes`, on the gateway state; large WebSocket frames count the same way).
`BodyGuard` (pure ASGI, inside the request-id middleware) counts them, recording a refusal as
its answer starts; and once a key's total reaches `max_refused_body_bytes_per_minute` it
answers that key's bodies over `SMALL_BODY` (or of unknown length: chunked, or a
Content-Length beside chunked framing) from the headers alone: 429 `rate_limited` with
`Retry-After`, the whole seconds until the total falls below the limit again. While a key has
refusals on record its large bodies are read one at a time (`_Turns`: the next one starts when
the answer starts, or `HANDOFF_S` after the body was read), so a burst is counted body by body
rather than all read before the first refusal lands. A request whose client went away is not
counted. A large body without a valid key is answered 401 the same way: it could never be
served.

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

from gateway.policy.ratelimit import SMALL_BODY, counts_as_refused, refused_error
from gateway.protocol.errors import GatewayError, error_response

if TYPE_CHECKING:
    from litestar.types import ASGIApp, Message, Receive, Scope, Send

    from gateway.policy.ratelimit import RefusedBytes
    from gateway.server.state import GatewayState

__all__ = ("DRAIN_LIMIT", "BodyGuard")

log = structlog.get_logger(__name__)

DRAIN_LIMIT = 64 * 1024 * 1024  # a refused body up to this size is read (and dropped) first
HANDOFF_S = 0.5  # a key's next large body waits at most this long after the last one was read
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


class _Line:
    """One owner's turn-taking: its lock and how many hold or wait for it."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class _Turn:
    """A held turn; releasing it twice is a no-op."""

    __slots__ = ("line", "owner", "released")

    def __init__(self, owner: str, line: _Line) -> None:
        self.owner, self.line, self.released = owner, line, False


class _Turns:
    """Per owner, one large body read at a time (while the owner has refusals on record), so
    a burst of concurrent bodies is counted one by one instead of all read before the first
    refusal lands. A turn passes on when its answer starts, or `HANDOFF_S` after its body
    was read, whichever comes first: a refusal lands within that time, and a request that is
    served (a streamed answer may start only after its images are encoded) holds up the
    key's next body no longer."""

    __slots__ = ("_lines",)

    def __init__(self) -> None:
        self._lines: dict[str, _Line] = {}

    async def acquire(self, owner: str) -> _Turn:
        line = self._lines.get(owner)
        if line is None:
            line = self._lines[owner] = _Line()
        line.users += 1
        try:
            await line.lock.acquire()
        except BaseException:  # cancelled while waiting (the client went away)
            self._leave(owner, line)
            raise
        return _Turn(owner, line)

    def release(self, turn: _Turn) -> None:
        if turn.released:
            return
        turn.released = True
        turn.line.lock.release()
        self._leave(turn.owner, turn.line)

    def _leave(self, owner: str, line: _Line) -> None:
        line.users -= 1
        if line.users <= 0 and self._lines.get(owner) is line:
            del self._lines[owner]


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
        retry = refused.retry_after(owner)
        turn: _Turn | None = None
        if retry is None and refused.total(owner) > 0:
            turn = await self._turns.acquire(owner)
            retry = refused.retry_after(owner)  # what the turns ahead added
        if retry is not None:
            if turn is not None:
                self._turns.release(turn)
            await self._answer(scope, receive, send, length, refused_error(refused.limit, retry))
            return
        await self._serve(scope, receive, send, owner, turn)

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, owner: str, turn: _Turn | None
    ) -> None:
        """Run the app, counting the body's bytes. A refusal is recorded as soon as its answer
        starts, before the client reads it; a request whose client went away is not counted
        (its 4xx says so, not what it sent). The turn, if any, is always released."""
        read = 0
        recorded = gone = False
        handoff: asyncio.TimerHandle | None = None

        def pass_turn() -> None:
            if turn is not None:
                self._turns.release(turn)

        def settle(status: int) -> None:
            nonlocal recorded
            if not recorded:
                recorded = True
                if counts_as_refused(status) and not gone:
                    self.refused.add(owner, read)
            if handoff is not None:
                handoff.cancel()
            pass_turn()

        async def counting_receive() -> Message:
            nonlocal read, gone, handoff
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if not message.get("more_body", False) and turn is not None and handoff is None:
                    handoff = asyncio.get_running_loop().call_later(HANDOFF_S, pass_turn)
            elif message["type"] == "http.disconnect":
                gone = True
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
