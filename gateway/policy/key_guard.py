"""Managed API keys at the edge: looked up before routing, and watched while a WebSocket is open.

`KeyResolver` wraps the ASGI app: for every HTTP request and WebSocket handshake that carries a
managed key it awaits `Authenticator.prefetch` (cache, else the key store), so that the
transports' synchronous `Authenticator.owner()` finds the answer. A store that cannot be read is
answered here, `busy` (503) for HTTP and a 1013 close for a WebSocket, rather than letting the
request in. Requests without a managed key (no key, a static one, or no key store) pass through
untouched.

`watch_key` runs beside an open WebSocket: every `Authenticator.cache_ttl_s` it asks again
whether the connection's key still stands; once it is revoked or expired it calls the
connection's `on_refused(error)` (which sends the error event and closes), and if the handler
is still running a few seconds later, cancels it. A store outage does not end connections.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from gateway.protocol.errors import GatewayError, error_response

if TYPE_CHECKING:
    from gateway.policy.auth import Authenticator

__all__ = ("CLOSE_GRACE_S", "KeyResolver", "watch_key")

CLOSE_GRACE_S = 3.0  # after a refused key's close, how long the handler may take to end

Scope = dict[str, Any]
ASGIApp = Callable[
    [Scope, Callable[..., Awaitable[Any]], Callable[..., Awaitable[Any]]], Awaitable[None]
]


def _headers(scope: Scope) -> dict[str, str]:
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            return {"authorization": value.decode("latin-1")}
    return {}


class KeyResolver:
    __slots__ = ("app", "auth")

    def __init__(self, app: ASGIApp, auth: Authenticator) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if self.auth.store is None or kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        try:
            await self.auth.prefetch(_headers(scope), scope.get("subprotocols") or ())
        except GatewayError as exc:
            if kind == "websocket":
                await send({"type": "websocket.close", "code": 1013, "reason": exc.code})
                return
            body = msgspec.json.encode({"error": error_response(exc).error})
            await send(
                {
                    "type": "http.response.start",
                    "status": exc.http_status,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"retry-after", b"1"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


@contextlib.asynccontextmanager
async def watch_key(
    auth: Authenticator,
    headers: Mapping[str, str],
    subprotocols: Iterable[str],
    on_refused: Callable[[GatewayError], Awaitable[None]],
    *,
    check: Callable[[], Awaitable[object]] | None = None,
) -> AsyncIterator[None]:
    """While the body runs, refuse the connection once its managed key stops being valid.
    `check` replaces the question asked (an ephemeral key's connection asks about its parent)."""
    if auth.store is None:
        yield
        return
    auth_header = headers.get("authorization")
    headers = {"authorization": auth_header} if auth_header else {}
    offered = list(subprotocols)
    host = asyncio.current_task()
    running = True

    async def watch() -> None:
        while True:
            await asyncio.sleep(auth.cache_ttl_s)
            try:
                await (check() if check is not None else auth.resolve(headers, offered))
            except GatewayError as exc:
                if exc.code == "busy":  # the store is down: keep what is open
                    continue
                try:
                    await on_refused(exc)
                finally:
                    await asyncio.sleep(CLOSE_GRACE_S)
                    if running and host is not None:
                        host.cancel()
                return

    watcher = asyncio.create_task(watch(), name="watch key")
    try:
        yield
    finally:
        running = False
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
