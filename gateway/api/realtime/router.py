"""The `/v1/realtime` route: the WebSocket handshake, before a connection exists.

A key travels in `Authorization: Bearer <key>` or, from a browser, as the offered subprotocol
`openai-insecure-api-key.<key>` beside `realtime` (`gateway.policy.auth`). A key in the URL
(`?api_key=`) is refused: the socket is accepted only to say why in the close reason (close
1008), since a refusal before the handshake reaches a browser as a bare 403. A missing or wrong
key closes with 1008 and the auth error's message. Everything after the handshake (the accepted
subprotocol, which never echoes the key; the session; the events) is `RealtimeConnection`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from litestar import WebSocket, websocket

from gateway.api.realtime.channel import CLOSE_POLICY
from gateway.api.realtime.connection import RealtimeConnection
from gateway.policy.auth import QUERY_KEY_REFUSED, public_subprotocol
from gateway.policy.key_guard import watch_key
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from litestar.handlers import WebsocketRouteHandler

    from gateway.server.state import GatewayState

__all__ = ("realtime_route",)


def realtime_route(state: GatewayState) -> WebsocketRouteHandler:
    """`/v1/realtime`: authenticate the upgrade, then hand the socket to a `RealtimeConnection`."""

    @websocket("/v1/realtime")
    async def realtime(socket: WebSocket) -> None:
        query = socket.query_params
        offered = socket.scope.get("subprotocols") or []
        if "api_key" in query:
            # accepted only to say why: a refusal before the handshake reaches a browser as a
            # bare 403 with no reason
            await socket.accept(subprotocols=public_subprotocol(offered))
            await socket.close(code=CLOSE_POLICY, reason=QUERY_KEY_REFUSED)
            return
        try:
            owner = state.auth.owner(socket.headers, offered)
        except GatewayError as exc:
            await socket.close(code=CLOSE_POLICY, reason=exc.message)
            return
        connection = RealtimeConnection(socket, state, owner)

        async def key_refused(exc: GatewayError) -> None:  # revoked or expired while open
            await connection._send_error(exc, None)
            await socket.close(code=CLOSE_POLICY, reason=exc.code)

        async with watch_key(state.auth, socket.headers, offered, key_refused):
            await connection.run(query.get("session_id"), model=query.get("model"))

    return realtime
