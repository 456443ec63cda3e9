"""The one way out of a Realtime connection: server events, in order, on an open socket.

`EventSender.send` encodes an event in the connection's negotiated codec (`codec`, set once the
subprotocol is chosen) and hands the ASGI message to `out`: the server's own send once the
socket is accepted (`gateway.api.http.server_send`: every event of a response passes here, and
the middleware wrappers between only act on the accept), else Litestar's. A text delta's frame
encoded ahead (`text_frames`) goes out by `write_text` where the server writes frames straight
to the socket (`gateway.server.websocket_frames`) and nothing waits ahead of it, else by
`send_text`, as `send` sends; `send` writes a JSON event's frame the same way first.
`send_error` turns a `GatewayError` into an `error` event echoing the client's `event_id`, and
counts it.

Invariants: nothing is sent unless the connection is OPEN (`ConnectionState.phase`); sends go
out in the order they were made (one that finds another still under way, a socket draining,
waits behind it on a lock; the others take none); a send to a peer that went away is dropped
quietly (the receive loop sees the disconnect). Event ids are `event_000001`,
`event_000002`, ... per connection (`eid`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog

from gateway.api.realtime import protocol as rt
from gateway.api.realtime.connection_state import ConnState

if TYPE_CHECKING:
    from gateway.api.realtime.connection_state import ConnectionState
    from gateway.protocol.errors import GatewayError
    from gateway.telemetry import GatewayMetrics

__all__ = ("EventSender", "Out")

log = structlog.get_logger("visiongate.realtime")

Out = Callable[[dict[str, Any]], Awaitable[None]]  # an ASGI send

_OPEN = ConnState.OPEN


class EventSender:
    """Sends one connection's server events (see the module for its invariants)."""

    __slots__ = ("_conn", "_lock", "_metrics", "_out", "_sending", "_seq", "_write", "codec")

    def __init__(
        self,
        conn: ConnectionState,
        out: Out,
        metrics: GatewayMetrics,
        write: Callable[[bytes], bool] | None = None,
    ) -> None:
        self._conn = conn
        self._out = out
        # the server's direct text-frame writer (gateway.server.websocket_frames), if it has one
        self._write = write
        self._metrics = metrics
        self.codec = rt.WireCodec()  # JSON until the connection negotiates msgpack
        self._lock = asyncio.Lock()
        self._sending = False  # a send is under way outside the lock
        self._seq = 0

    def eid(self) -> str:
        self._seq += 1
        return f"event_{self._seq:06d}"

    async def send(self, event: rt.ServerEvent) -> None:
        if self._conn.phase is not _OPEN:
            return
        codec = self.codec
        data = codec.encode(event)
        if not codec.binary and self.write_text(data):  # written at once, as a delta's frame
            return
        if codec.binary:
            message = {"type": "websocket.send", "bytes": data, "text": None}
        else:
            message = {"type": "websocket.send", "bytes": None, "text": data.decode()}
        if self._sending or self._lock.locked():
            # another send waits for the socket to drain: queue behind it, in order
            async with self._lock:
                await self._deliver(message, event)
            return
        self._sending = True  # a send that never suspends (nearly all) takes no lock
        try:
            await self._deliver(message, event)
        finally:
            self._sending = False

    def write_text(self, payload: bytes) -> bool:
        """A text delta's frame (`text_frames.TextDeltaFrames`, UTF-8) written at once by the
        server, where it offers that, the connection is open and no send waits ahead of it;
        False, nothing sent: `send_text` it (the hot path of a response: no coroutine here)."""
        write = self._write
        if write is None or self._sending or self._lock.locked() or self._conn.phase is not _OPEN:
            return False
        return write(payload)

    async def send_text(self, payload: bytes) -> None:
        """A text delta's frame, already encoded (`text_frames.TextDeltaFrames`, UTF-8), sent
        as `send` sends an event: the delivery is written out here."""
        if self._conn.phase is not _OPEN:
            return
        message = {"type": "websocket.send", "bytes": None, "text": payload.decode()}
        if self._sending or self._lock.locked():
            async with self._lock:
                await self._deliver(message, rt.OutputTextDelta)
            return
        self._sending = True
        try:
            await self._out(message)
        except Exception:  # as in `_deliver`
            log.debug("send_failed", event_type="OutputTextDelta")
        finally:
            self._sending = False

    async def _deliver(self, message: dict[str, Any], event: object) -> None:
        try:
            await self._out(message)
        except Exception:  # the peer went away; the receive loop will see the disconnect
            kind = event if isinstance(event, type) else type(event)
            log.debug("send_failed", event_type=kind.__name__)

    async def send_error(self, exc: GatewayError, event_id: str | None) -> None:
        self._metrics.record_error(code=exc.code, api="realtime")
        log.info("client_error", code=exc.code, message=exc.message, event_id=event_id)
        await self.send(
            rt.ErrorEvent(
                self.eid(),
                rt.ErrorBody(
                    type=exc.type,
                    code=exc.code,
                    message=exc.message,
                    param=exc.param,
                    event_id=event_id,
                ),
            )
        )
