"""The server's own ASGI `send` for a WebSocket's frames, past the middleware around the app.

Every middleware in the gateway's stack that wraps `send` (request ids, rate-limit headers,
Litestar's exception handling, its OpenTelemetry middleware, which skips `/v1/realtime`) acts
only on the message that opens a response: `websocket.accept` or `http.response.start`. A
Realtime response sends a frame per text delta, and through the stack each of them took one
call of every wrapper, for nothing. `ServerSend`, outermost, keeps the `send` the server gave
for a WebSocket in its scope; `server_send(scope)` hands it back, and a connection sends its
`websocket.send` frames there once accepted. The accept, the close and everything over HTTP
still go through the stack. A middleware that must see every frame is wrapped outside this one.
An HTTP scope keeps it as well: a streamed answer sends its body chunks there
(`gateway.api.http.sse_stream`), and its start and its end through the stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from litestar.types import ASGIApp, Receive, Scope, Send

__all__ = ("SCOPE_KEY", "ServerSend", "server_send")

SCOPE_KEY = "visiongate.server_send"


class ServerSend:
    """Pure ASGI, outermost: a WebSocket's or HTTP request's scope carries the server's
    `send`."""

    __slots__ = ("app",)

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":  # an SSE answer's chunks go there too (sse_stream.py)
            scope[SCOPE_KEY] = send  # type: ignore[literal-required]
        await self.app(scope, receive, send)


def server_send(scope: Scope) -> Send | None:
    """The server's `send` kept for this connection, or None (an app built without
    `ServerSend`)."""
    return scope.get(SCOPE_KEY)  # type: ignore[return-value]
