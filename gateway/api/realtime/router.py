"""The `/v1/realtime` route: the WebSocket handshake, before a connection exists.

A key travels in `Authorization: Bearer <key>` or, from a browser, as the offered subprotocol
`openai-insecure-api-key.<key>` beside `realtime` (`gateway.policy.auth`). A key in the URL
(`?api_key=`) is refused: the socket is accepted only to say why in the close reason (close
1008), since a refusal before the handshake reaches a browser as a bare 403. A missing or wrong
key closes with 1008 and the auth error's message. Everything after the handshake (the accepted
subprotocol, which never echoes the key; the session; the events) is `RealtimeConnection`'s.

An ephemeral key (`ek_...`, minted by `POST /v1/realtime/client_secrets`, `ephemeral`) is
granted by `Authenticator.grant`: the connection's owner is its parent key's, its session
settings are applied once the session is open, and while it is open the parent key is watched
(a revoked parent ends it). One refused at the handshake (unknown, expired, its parent gone) is
accepted only to say why: an `error` event with the code, then close 1008 with the code as
reason. `realtime_route` answers the WebSocket route and the minting routes together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from litestar import Router, WebSocket, websocket

from gateway.api.realtime import protocol as rt
from gateway.api.realtime.connection import CLOSE_POLICY, CLOSE_TRY_AGAIN, RealtimeConnection
from gateway.api.realtime.ephemeral import ephemeral_routes
from gateway.policy.auth import QUERY_KEY_REFUSED, key_of, public_subprotocol
from gateway.policy.client_secrets import is_ephemeral
from gateway.policy.key_guard import watch_key
from gateway.protocol.errors import GatewayError
from gateway.protocol.subprotocols import MSGPACK_SUBPROTOCOL

if TYPE_CHECKING:
    from gateway.server.state import GatewayState

__all__ = ("realtime_route",)


async def _refuse_ephemeral(socket: WebSocket, offered: list[str], exc: GatewayError) -> None:
    """Accept only to say why an ephemeral key is refused: the error event, then close 1008."""
    chosen = public_subprotocol(offered)
    await socket.accept(subprotocols=chosen)
    codec = rt.WireCodec(binary=chosen == MSGPACK_SUBPROTOCOL)
    frame = codec.encode(
        rt.ErrorEvent(
            "evt_refused", rt.ErrorBody(type=exc.type, code=exc.code, message=exc.message)
        )
    )
    if codec.binary:
        await socket.send_bytes(frame)
    else:
        await socket.send_text(frame.decode())
    # a store that cannot be read is "try again later", as for managed keys
    await socket.close(
        code=CLOSE_TRY_AGAIN if exc.code == "busy" else CLOSE_POLICY, reason=exc.code
    )


def realtime_route(state: GatewayState) -> Router:
    """`/v1/realtime`: authenticate the upgrade, then hand the socket to a `RealtimeConnection`;
    beside it, the routes that mint ephemeral keys for it."""

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
            grant = await state.auth.grant(socket.headers, offered)
        except GatewayError as exc:
            if is_ephemeral(key_of(socket.headers, offered)):
                await _refuse_ephemeral(socket, offered, exc)
            else:
                await socket.close(code=CLOSE_POLICY, reason=exc.message)
            return
        connection = RealtimeConnection(socket, state, grant.owner)
        ephemeral = grant.ephemeral

        async def key_refused(exc: GatewayError) -> None:  # revoked or expired while open
            await connection.sender.send_error(exc, None)
            await socket.close(code=CLOSE_POLICY, reason=exc.code)

        async def parent_stands() -> object:  # an ephemeral key's connection: its parent key
            assert ephemeral is not None
            return await state.auth.check_parent(ephemeral)

        check = parent_stands if ephemeral is not None else None
        async with watch_key(state.auth, socket.headers, offered, key_refused, check=check):
            await connection.run(
                query.get("session_id"),
                model=query.get("model"),
                session_settings=ephemeral.session if ephemeral is not None else b"",
            )

    return Router(path="/", route_handlers=[realtime, ephemeral_routes(state)])
