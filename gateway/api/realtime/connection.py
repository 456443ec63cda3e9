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
before it is `router`, and each kind of event has its own module over the shared state of
`channel.Channel`: `session_events` (the session, `session.update`), `item_events`
(`conversation.item.*`, pre-encodes, KV warm-up) and `response_events` (`response.create`,
`response.cancel`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from gateway.api.realtime import protocol as rt
from gateway.api.realtime.channel import CLOSE_POLICY, CLOSE_TRY_AGAIN, ConnState, log
from gateway.api.realtime.item_events import ItemEvents
from gateway.api.realtime.response_events import ResponseEvents
from gateway.api.realtime.session_events import SessionEvents
from gateway.caching.redis_deadline import open_request_budget
from gateway.chat.requests import check_model
from gateway.policy.auth import public_subprotocol
from gateway.policy.ratelimit import SMALL_BODY, counts_as_refused, refused_error
from gateway.protocol.errors import GatewayError
from gateway.protocol.subprotocols import MSGPACK_SUBPROTOCOL
from gateway.server.state import not_ready

__all__ = ("ConnState", "RealtimeConnection")


class RealtimeConnection(SessionEvents, ItemEvents, ResponseEvents):
    """One WebSocket from accept to close: open the session, read frames until the client
    goes, hand each event to its handler, then stop the response in progress."""

    # ------------------------------------------------------------ lifecycle

    async def run(
        self, session_id: str | None, *, model: str | None = None, session_settings: bytes = b""
    ) -> None:
        # answer with a subprotocol that carries no key: never echo `openai-insecure-api-key.*`
        chosen = public_subprotocol(self.socket.scope.get("subprotocols") or [])
        self.codec = rt.WireCodec(binary=chosen == MSGPACK_SUBPROTOCOL)
        await self.socket.accept(subprotocols=chosen)
        self._transition(ConnState.OPEN)
        if not self.state.ready:  # in the negotiated codec, then "try again later"
            await self._send_error(not_ready(), None)
            await self.socket.close(code=CLOSE_TRY_AGAIN, reason="not ready")
            self._transition(ConnState.CLOSED)
            return
        try:
            check_model(model, self.state.engine.model_id, "model")
        except GatewayError as exc:  # a client built for another model: say so, then close
            await self._send_error(exc, None)
            await self.socket.close(code=CLOSE_POLICY, reason=exc.code)
            self._transition(ConnState.CLOSED)
            return
        metrics = self.state.metrics
        metrics.ws_connection_opened()
        try:
            open_request_budget(self.state.settings.store_timeout_s)
            if not await self._open_session(session_id):
                return
            if session_settings:
                await self._apply_settings(session_settings)
            await self._receive_loop()
        finally:
            self._transition(ConnState.CLOSED)
            metrics.ws_connection_closed()
            await self._shutdown()

    async def _shutdown(self) -> None:
        # A client that goes away mid-response frees the engine at once; pre-encodes are left
        # to finish, since their tokens land in the shared cache for the next turn.
        if self.response_options is not None:
            self.response_options.cancel.set()
        if self.response_task is not None and not self.response_task.done():
            self.response_task.cancel()
            await asyncio.gather(self.response_task, return_exceptions=True)
        # image watchers run to their end (bounded by the encode): one whose image fails still
        # removes the item from the session; their events go nowhere now
        if self.watchers:
            await asyncio.gather(*list(self.watchers), return_exceptions=True)

    async def _apply_settings(self, raw: bytes) -> None:
        try:
            config = msgspec.json.decode(raw, type=rt.SessionConfig)
            await self._session_update(rt.SessionUpdate(session=config))
        except (GatewayError, msgspec.ValidationError) as exc:
            error = (
                exc if isinstance(exc, GatewayError) else GatewayError("invalid_request", str(exc))
            )
            await self._send_error(error, None)

    async def _receive_loop(self) -> None:
        while True:
            message = await self.socket.receive()
            if message["type"] == "websocket.disconnect":
                return
            frame: Any = message.get("text")
            if frame is None:
                frame = message.get("bytes")
            if frame is None:
                continue
            await self._handle_frame(frame)

    # ------------------------------------------------------------ events

    async def _handle_frame(self, frame: str | bytes) -> None:
        event_id = None
        # each client event (with the response it starts) waits for Redis within its own bound
        open_request_budget(self.state.settings.store_timeout_s)
        # large frames as large HTTP bodies (gateway/api/http/body_guard.py): counted when refused,
        # and not decoded while the key's refused bytes are over the limit
        refused = self.state.refused
        size = len(frame) if isinstance(frame, bytes) or frame.isascii() else len(frame.encode())
        large = size > SMALL_BODY
        if large:
            retry = refused.retry_after(self.owner)
            if retry is not None:  # not decoded: its event id is unknown
                await self._send_error(refused_error(refused.limit, retry), None)
                return
        try:
            event = self.codec.decode(frame)
            event_id = event.event_id
            if isinstance(event, rt.ConversationItemCreate):
                await self._item_create(event)
            elif isinstance(event, rt.ResponseCreate):
                await self._response_create(event)
            elif isinstance(event, rt.ResponseCancel):
                await self._response_cancel(event)
            elif isinstance(event, rt.SessionUpdate):
                await self._session_update(event)
            elif isinstance(event, rt.ConversationItemRetrieve):
                await self._item_retrieve(event)
            elif isinstance(event, rt.ConversationItemDelete):
                await self._item_delete(event)
            elif isinstance(event, rt.ConversationItemTruncate):
                await self._item_truncate(event)
        except GatewayError as exc:
            if large and counts_as_refused(exc.http_status):
                refused.add(self.owner, size)
            decoded_id = getattr(exc, "event_id", None)
            await self._send_error(exc, decoded_id if decoded_id is not None else event_id)
        except Exception as exc:  # a bug must not take the connection down with it
            log.exception("realtime_event_failed")
            await self._send_error(
                GatewayError("internal_error", f"internal error: {type(exc).__name__}"), event_id
            )
