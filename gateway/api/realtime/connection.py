"""`/v1/realtime`: one WebSocket connection speaking the Realtime API's text-and-image subset.

A connection owns one session (new, or resumed with `?session_id=`), at most one response in
progress, and the pre-encodes of the images it has sent. Every client frame is decoded by one
made-once decoder; anything wrong with a frame becomes an `error` event echoing the client's
`event_id`, and the connection stays open. The codec refuses frames of the wrong shape
(`invalid_event`); the values in them are checked by the request layer
(`gateway.chat.requests`), with the same codes as over HTTP. Images start encoding the moment
their item arrives, at most `max_pending_encodes_per_connection` at a time per connection (and
`max_pending_encodes_per_key` per API key): an item past either is refused with `rate_limited`
and nothing of it is kept. A model named in the URL (`?model=`, as the OpenAI SDKs send it) or in
`session.update` must be the served one (the one `/v1/models` lists): another is refused with
`model_not_found`, the connection closed (URL) or the session left unchanged (update). The
session settings an ephemeral key was minted with (`session_settings`, JSON of a `session`
object) are applied once the session is open, as a `session.update` from the client would be
(its `session.updated` follows `session.created`); one that no longer passes is an `error`
event and the session keeps its settings.

This module is the connection's lifecycle and its dispatch of client frames; the handshake
before it is `router`. `RealtimeConnection` holds the connection's state
(`connection_state.ConnectionState`) and its way out (`event_sender.EventSender`), and once the
gateway is ready builds one handler per kind of event over them, each given only the parts of
the gateway it uses: `session_events.SessionEvents` (the session, `session.update`),
`item_events.ItemEvents` (`conversation.item.*`, pre-encodes, KV warm-up) and
`response_events.ResponseEvents` (`response.create`, `response.cancel`). Each client event goes
to its handler by its type.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog

from gateway.api.http.server_send import server_send
from gateway.api.realtime import protocol as rt
from gateway.api.realtime.connection_state import ConnectionState, ConnState
from gateway.api.realtime.event_sender import EventSender
from gateway.api.realtime.item_events import ItemEvents
from gateway.api.realtime.response_events import ResponseEvents
from gateway.api.realtime.session_events import SessionEvents
from gateway.caching.redis_deadline import open_request_budget
from gateway.chat.requests import RequestLimits, check_model
from gateway.chat.vision_resolver import EncodeQuota
from gateway.policy.auth import public_subprotocol
from gateway.policy.ratelimit import SMALL_BODY, counts_as_refused, refused_error
from gateway.protocol.errors import GatewayError
from gateway.protocol.subprotocols import MSGPACK_SUBPROTOCOL
from gateway.server.state import not_ready
from gateway.server.websocket_frames import text_writer

if TYPE_CHECKING:
    from litestar import WebSocket

    from gateway.server.state import GatewayState, Serving

__all__ = ("CLOSE_POLICY", "CLOSE_TRY_AGAIN", "RealtimeConnection")

log = structlog.get_logger("visiongate.realtime")

# WebSocket close codes (RFC 6455): a refusal the client must change something to get past (a
# key in the URL, a bad key, another model, an unknown session), and "try again later" (not
# ready, the session store down)
CLOSE_POLICY = 1008
CLOSE_TRY_AGAIN = 1013

Handle = Callable[[Any], Awaitable[None]]


class RealtimeConnection:
    """One WebSocket from accept to close: open the session, read frames until the client
    goes, hand each event to its handler, then stop the response in progress."""

    def __init__(self, socket: WebSocket, gateway: GatewayState, owner: str) -> None:
        self.socket = socket
        self.gateway = gateway
        settings = gateway.settings
        self.conn = ConnectionState(
            owner,
            EncodeQuota(settings.max_pending_encodes_per_connection, "this connection"),
        )
        # every frame to the server's own send once accepted (server_send.py), else Litestar's;
        # text deltas straight to the socket where the server offers that (websocket_frames.py)
        self.sender = EventSender(
            self.conn,
            server_send(socket.scope) or socket.send,
            gateway.metrics,
            text_writer(socket.scope),
        )

    # ------------------------------------------------------------ lifecycle

    async def run(
        self, session_id: str | None, *, model: str | None = None, session_settings: bytes = b""
    ) -> None:
        gateway, socket, sender = self.gateway, self.socket, self.sender
        # answer with a subprotocol that carries no key: never echo `openai-insecure-api-key.*`
        chosen = public_subprotocol(socket.scope.get("subprotocols") or [])
        sender.codec = rt.WireCodec(binary=chosen == MSGPACK_SUBPROTOCOL)
        await socket.accept(subprotocols=chosen)
        self.conn.transition(ConnState.OPEN)
        if not gateway.ready:  # in the negotiated codec, then "try again later"
            await sender.send_error(not_ready(), None)
            await socket.close(code=CLOSE_TRY_AGAIN, reason="not ready")
            self.conn.transition(ConnState.CLOSED)
            return
        try:
            check_model(model, gateway.engine.model_id, "model")
        except GatewayError as exc:  # a client built for another model: say so, then close
            await sender.send_error(exc, None)
            await socket.close(code=CLOSE_POLICY, reason=exc.code)
            self.conn.transition(ConnState.CLOSED)
            return
        session, items, responses = self._handlers(gateway.require())
        routes: dict[type, Handle] = {
            rt.ConversationItemCreate: items.create,
            rt.ResponseCreate: responses.create,
            rt.ResponseCancel: responses.cancel,
            rt.SessionUpdate: session.update,
            rt.ConversationItemRetrieve: items.retrieve,
            rt.ConversationItemDelete: items.delete,
            rt.ConversationItemTruncate: items.truncate,
        }
        metrics = gateway.metrics
        metrics.ws_connection_opened()
        try:
            open_request_budget(gateway.settings.store_timeout_s)
            try:
                await session.open(session_id)
            except GatewayError as exc:  # an unknown session, or the store down
                await sender.send_error(exc, None)
                policy = exc.code == "session_not_found"
                await socket.close(
                    code=CLOSE_POLICY if policy else CLOSE_TRY_AGAIN, reason=exc.code
                )
                return
            if session_settings:
                await session.apply_minted(session_settings)
            await self._receive_loop(routes)
        finally:
            self.conn.transition(ConnState.CLOSED)
            metrics.ws_connection_closed()
            # A client that goes away mid-response frees the engine at once; pre-encodes are
            # left to finish, since their tokens land in the shared cache for the next turn,
            # and their watchers run to their end (their events go nowhere now)
            await responses.stop()
            await items.settle()

    def _handlers(self, serving: Serving) -> tuple[SessionEvents, ItemEvents, ResponseEvents]:
        gateway, conn, sender = self.gateway, self.conn, self.sender
        settings, model = gateway.settings, gateway.engine.model_id
        limits = RequestLimits.of(settings)
        return (
            SessionEvents(
                conn,
                sender,
                gateway.sessions,
                model=model,
                limits=limits,
                default_instructions=settings.default_instructions,
            ),
            ItemEvents(
                conn,
                sender,
                gateway.sessions,
                serving.vision,
                serving.service,
                limits=limits,
                kv_warmup=settings.kv_warmup,
            ),
            ResponseEvents(
                conn,
                sender,
                gateway.sessions,
                serving.vision,
                serving.service,
                limits=limits,
                rate_limiter=gateway.rate_limiter,
                model=model,
            ),
        )

    async def _receive_loop(self, routes: dict[type, Handle]) -> None:
        receive = self.socket.receive
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            frame: Any = message.get("text")
            if frame is None:
                frame = message.get("bytes")
            if frame is None:
                continue
            await self._handle_frame(frame, routes)

    # ------------------------------------------------------------ events

    async def _handle_frame(self, frame: str | bytes, routes: dict[type, Handle]) -> None:
        gateway, owner = self.gateway, self.conn.owner
        event_id = None
        # each client event (with the response it starts) waits for Redis within its own bound
        open_request_budget(gateway.settings.store_timeout_s)
        # large frames as large HTTP bodies (gateway/api/http/body_guard.py): counted when refused,
        # and not decoded while the key's refused bytes are over the limit
        refused = gateway.refused
        size = len(frame) if isinstance(frame, bytes) or frame.isascii() else len(frame.encode())
        large = size > SMALL_BODY
        if large:
            retry = refused.retry_after(owner)
            if retry is not None:  # not decoded: its event id is unknown
                await self.sender.send_error(refused_error(refused.limit, retry), None)
                return
        try:
            event = self.sender.codec.decode(frame)
            event_id = event.event_id
            handle = routes.get(type(event))
            if handle is not None:
                await handle(event)
        except GatewayError as exc:
            if large and counts_as_refused(exc.http_status):
                refused.add(owner, size)
            decoded_id = getattr(exc, "event_id", None)
            await self.sender.send_error(exc, decoded_id if decoded_id is not None else event_id)
        except Exception as exc:  # a bug must not take the connection down with it
            log.exception("realtime_event_failed")
            await self.sender.send_error(
                GatewayError("internal_error", f"internal error: {type(exc).__name__}"), event_id
            )
