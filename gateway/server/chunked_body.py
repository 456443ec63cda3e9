"""A streamed response's body chunks written straight to the socket, past h11's event machinery.

uvicorn hands every `http.response.body` message to h11: an `h11.Data` event, the connection's
state machine (which a chunk leaves as it is: the response stays in SEND_BODY), its writer
(for a chunked response, the chunk's size in hex, the bytes and CRLF) and a join of the parts.
For an SSE answer of a few hundred deltas that is most of the server's own work a chunk.
`ChunkedCycle` is uvicorn's request/response cycle with one shortcut: once h11 has chosen
chunked framing for the response (HTTP/1.1, no Content-Length, not a HEAD request), a body
message with more to come is framed here, in the same bytes h11 would write, after the same
flow-control wait and disconnect check. The start, the last body message, every other framing
and everything after the response goes through uvicorn and h11 as before, so h11's state stays
right. `GuardedH11Protocol` (gateway/server/runner.py) gives each cycle this class. Where h11
has no `ChunkedWriter` to recognise the framing by (a private name of h11's), cycles are left
as uvicorn made them.

A cycle also offers its app a writer for such chunks, in the scope's ASGI extensions under
`CHUNKS`: `{"write": write}`, where `write(body)` writes a chunk at once and returns True where
the ASGI `send` of a body message with more to come would write the same bytes without waiting
(chunked framing chosen, the response not complete, the client there, the transport taking
writes), and otherwise writes nothing and returns False: that chunk goes to `send`, in order.
The same entry offers `"watch": watch`, where `watch(callback)` has `callback` called once if
the client goes before the response is complete (at once if it already has) and returns what
stops the watch: an app streaming a body hears of a disconnect without a second task waiting in
`receive` for `http.disconnect`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.h11_impl import RequestResponseCycle

try:
    from h11._writers import ChunkedWriter
except ImportError:  # pragma: no cover - another h11: every chunk goes through h11
    ChunkedWriter = None

if TYPE_CHECKING:
    from uvicorn._types import ASGISendEvent

__all__ = ("CHUNKS", "ChunkedCycle", "adopt", "chunk_writer", "disconnect_watch")

CHUNKS = "visiongate.http.chunks"


class ChunkedCycle(RequestResponseCycle):
    """uvicorn's cycle; a chunked response's body chunks skip h11 (module docstring)."""

    # set once the response has started, from the writer h11 chose for it
    chunked = False
    # what `watch` was given and not yet called or stopped (None: nothing watches)
    watchers: list[Callable[[], None]] | None = None

    async def send(self, message: ASGISendEvent) -> None:
        if self.chunked and message["type"] == "http.response.body":
            more = message.get("more_body", False)
            if more and not self.response_complete:
                if self.flow.write_paused and not self.disconnected:
                    await self.flow.drain()
                if self.disconnected:
                    return
                body = message.get("body", b"")
                if body:  # h11 writes nothing for an empty chunk: it would end the body
                    self.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
                return
        started = self.response_started
        await super().send(message)
        if not started and self.response_started:
            self.chunked = type(self.conn._writer) is ChunkedWriter

    def write_chunk(self, body: bytes) -> bool:
        """Write `body` as one chunk now, where `send` would write it without waiting (the
        module docstring); False, and nothing written, anywhere else."""
        if (
            not self.chunked
            or self.response_complete
            or self.disconnected
            or self.flow.write_paused
        ):
            return False
        if body:  # as `send`: an empty chunk would end the body
            self.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` once if the client goes before the response is complete (at once if
        it has gone); the callable returned stops the watch. Reading is resumed, as `receive`
        does, so that a client's close is heard."""
        if self.disconnected:
            callback()
            return _nothing
        if self.response_complete:
            return _nothing
        if self.watchers is None:
            self.watchers = []
        self.watchers.append(callback)
        self.flow.resume_reading()
        return partial(self._unwatch, callback)

    def _unwatch(self, callback: Callable[[], None]) -> None:
        if self.watchers is not None and callback in self.watchers:
            self.watchers.remove(callback)

    def gone(self) -> None:
        """The connection was lost (the protocol calls this after uvicorn's `connection_lost`):
        every watch hears it once, where the response was not complete."""
        watchers, self.watchers = self.watchers, None
        if watchers and self.disconnected:
            for callback in watchers:
                callback()


def _nothing() -> None:
    return None


def adopt(cycle: RequestResponseCycle | None) -> None:
    """Make a cycle uvicorn just created a `ChunkedCycle` (its ASGI task has not run yet:
    uvicorn schedules it)."""
    if type(cycle) is RequestResponseCycle and ChunkedWriter is not None:
        cycle.__class__ = ChunkedCycle
        extensions = cycle.scope.setdefault("extensions", {})  # type: ignore[typeddict-item]
        extensions[CHUNKS] = {"write": cycle.write_chunk, "watch": cycle.watch}  # type: ignore[attr-defined]


def _offered(scope: Mapping[str, Any], name: str) -> Any:
    offered = (scope.get("extensions") or {}).get(CHUNKS)
    return offered.get(name) if offered else None


def chunk_writer(scope: Mapping[str, Any]) -> Callable[[bytes], bool] | None:
    """The request's direct chunk writer, or None where its server offers none."""
    return _offered(scope, "write")


def disconnect_watch(
    scope: Mapping[str, Any],
) -> Callable[[Callable[[], None]], Callable[[], None]] | None:
    """The request's disconnect watch (`ChunkedCycle.watch`), or None where its server offers
    none."""
    return _offered(scope, "watch")
