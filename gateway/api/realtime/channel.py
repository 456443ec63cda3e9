"""The state one Realtime WebSocket connection holds, and how it sends events.

`Channel` is the base of `RealtimeConnection` (`gateway.api.realtime.connection`): the socket,
the negotiated codec, the session, the response in progress, the pre-encodes the connection
started and its session tools, and the one way out (`_send`, `_send_error`). The event handlers
(`session_events`, `item_events`, `response_events`) are mixins over it, each reading and
writing only these attributes, so each kind of client event reads in one module.

Invariants: the connection moves CONNECTING -> OPEN -> CLOSED, never back (`_transition`
asserts it); nothing is sent unless it is OPEN; sends go out in the order they were made (one
that finds another still under way, a socket draining, waits behind it on a lock; the others
take none), and a send to a peer that went away is dropped quietly (the receive loop sees the
disconnect). Event ids are `event_000001`, `event_000002`, ... per connection.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from gateway.api.http.server_send import server_send
from gateway.api.realtime import protocol as rt
from gateway.chat.requests import RequestLimits
from gateway.chat.vision_resolver import EncodeQuota

if TYPE_CHECKING:
    from litestar import WebSocket

    from gateway.chat.events import ResponseOptions
    from gateway.chat.vision_resolver import Resolved
    from gateway.protocol.errors import GatewayError
    from gateway.server.state import GatewayState
    from gateway.sessions.session import Session

__all__ = ("CLOSE_POLICY", "CLOSE_TRY_AGAIN", "Channel", "ConnState", "SessionTools")

log = structlog.get_logger("visiongate.realtime")

# WebSocket close codes (RFC 6455): a refusal the client must change something to get past (a
# key in the URL, a bad key, another model, an unknown session), and "try again later" (not
# ready, the session store down)
CLOSE_POLICY = 1008
CLOSE_TRY_AGAIN = 1013


class ConnState(enum.Enum):
    CONNECTING = "connecting"
    OPEN = "open"
    CLOSED = "closed"


@dataclass(slots=True)
class SessionTools:
    """The function tools `session.update` set: they live with the connection (as an OpenAI
    Realtime session does), checked when set."""

    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class Channel:
    """The state of one WebSocket: transitions CONNECTING -> OPEN -> CLOSED, never back."""

    def __init__(self, socket: WebSocket, state: GatewayState, owner: str) -> None:
        self.socket = socket
        self.state = state
        self.owner = owner
        self.conn_state = ConnState.CONNECTING
        self.codec = rt.WireCodec()
        self.limits = RequestLimits.of(state.settings)
        self.session: Session | None = None
        self.response_task: asyncio.Task[None] | None = None
        self.response_options: ResponseOptions | None = None
        self.tools = SessionTools()
        self.pending: dict[str, asyncio.Task[Resolved]] = {}  # digest -> pre-encode
        # pre-encodes this connection started and that have not finished
        self.encode_quota = EncodeQuota(
            state.settings.max_pending_encodes_per_connection, "this connection"
        )
        # item watchers -> the encodes they wait for
        self.watchers: dict[asyncio.Task[None], list[asyncio.Task[Resolved]]] = {}
        self._send_lock = asyncio.Lock()
        self._sending = False  # a send is under way outside the lock
        self._server_send = server_send(socket.scope)
        self._event_seq = 0
        self._warming: asyncio.Task[Any] | None = None  # this connection's KV warm-up
        self._warm_again = False  # items arrived while it ran

    def _transition(self, new: ConnState) -> None:
        legal = {
            ConnState.CONNECTING: {ConnState.OPEN, ConnState.CLOSED},
            ConnState.OPEN: {ConnState.CLOSED},
            ConnState.CLOSED: {ConnState.CLOSED},
        }
        assert new in legal[self.conn_state], f"illegal transition {self.conn_state} -> {new}"
        self.conn_state = new

    # ------------------------------------------------------------ sending

    def _eid(self) -> str:
        self._event_seq += 1
        return f"event_{self._event_seq:06d}"

    async def _send(self, event: rt.ServerEvent) -> None:
        if self.conn_state is not ConnState.OPEN:
            return
        data = self.codec.encode(event)
        # the ASGI message itself, to the server's own send once the socket is accepted
        # (`server_send`: every event of a response passes here, and the wrappers between
        # only act on the accept), else through Litestar's
        if self.codec.binary:
            message = {"type": "websocket.send", "bytes": data, "text": None}
        else:
            message = {"type": "websocket.send", "bytes": None, "text": data.decode()}
        send = self._server_send or self.socket.send
        if self._sending or self._send_lock.locked():
            # another send waits for the socket to drain: queue behind it, in order
            async with self._send_lock:
                await self._deliver(send, message, event)
            return
        self._sending = True  # a send that never suspends (nearly all) takes no lock
        try:
            await self._deliver(send, message, event)
        finally:
            self._sending = False

    async def _deliver(self, send: Any, message: dict[str, Any], event: rt.ServerEvent) -> None:
        try:
            await send(message)
        except Exception:  # the peer went away; the receive loop will see the disconnect
            log.debug("send_failed", event_type=type(event).__name__)

    async def _send_error(self, exc: GatewayError, event_id: str | None) -> None:
        self.state.metrics.record_error(code=exc.code, api="realtime")
        log.info("client_error", code=exc.code, message=exc.message, event_id=event_id)
        await self._send(
            rt.ErrorEvent(
                self._eid(),
                rt.ErrorBody(
                    type=exc.type,
                    code=exc.code,
                    message=exc.message,
                    param=exc.param,
                    event_id=event_id,
                ),
            )
        )
