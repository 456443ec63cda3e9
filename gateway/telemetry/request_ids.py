"""Request ids: one per HTTP request or WebSocket connection, shared by the client and the logs.

A client's own `X-Request-Id` is kept when it is a short token (1..128 characters of
``[A-Za-z0-9._:-]``); otherwise, or when none is sent, the gateway makes ``req_<32 hex>``.
`RequestIdMiddleware` runs outside everything else in the app, so every response carries the
id as its `x-request-id` header: successes, errors, a 404 of an unknown path, a 413, SSE streams,
static files, probes, and the upgrade response of an accepted WebSocket (the OpenAI SDKs read
it as `response._request_id` and `APIStatusError.request_id`). While the request runs the id
is bound in structlog's contextvars (`request_id` on every log line) and readable with
`current_request_id()` by what the request starts, such as its response trace; tasks started
from the request inherit both.

A WebSocket upgrade refused before it is accepted gets the server's bare 403, which carries no
headers of the app's; its log lines still carry the id.
"""

from __future__ import annotations

import re
import secrets
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import structlog
from opentelemetry import context as otel_context

if TYPE_CHECKING:
    from litestar import Litestar
    from litestar.types import ASGIApp, Message, Receive, Scope, Send

__all__ = (
    "REQUEST_ID_HEADER",
    "RequestIdMiddleware",
    "accept_request_id",
    "current_request_id",
    "new_request_id",
    "with_request_ids",
)

REQUEST_ID_HEADER = "x-request-id"
_HEADER = REQUEST_ID_HEADER.encode()
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# the messages that open a response: their headers are the response's headers
_RESPONSE_STARTS = frozenset(("http.response.start", "websocket.accept"))

_current: ContextVar[str | None] = ContextVar("visiongate_request_id", default=None)


def new_request_id() -> str:
    return f"req_{secrets.token_hex(16)}"


def accept_request_id(sent: str | bytes | None) -> str:
    """The client's id when it is a short token, else a new one: a client string of any size or
    content never reaches a header, a log line or a span."""
    if isinstance(sent, bytes):
        sent = sent.decode("latin-1")
    if sent is not None and _CLIENT_ID.fullmatch(sent):
        return sent
    return new_request_id()


def current_request_id() -> str | None:
    """The id of the request (or WebSocket connection) this code runs for, if any."""
    return _current.get()


def _sent_id(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == _HEADER:
            return value
    return None


class RequestIdMiddleware:
    """Pure ASGI: gives each HTTP request and WebSocket connection its id (see the module)."""

    __slots__ = ("app",)

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        request_id = accept_request_id(_sent_id(scope))
        header = (_HEADER, request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] in _RESPONSE_STARTS:
                headers: list[Any] = [
                    pair for pair in message.get("headers") or () if pair[0].lower() != _HEADER
                ]
                headers.append(header)
                message = {**message, "headers": headers}  # type: ignore[assignment]
            await send(message)

        token = _current.set(request_id)
        # Each request starts from an empty trace context: its spans come from its own
        # traceparent header or are new roots. The context this task inherited is not clean:
        # when a large body makes the server pause and resume reading, the connection's read
        # callback is re-registered from inside that request's task and keeps its context (its
        # span) for every later request on the connection.
        otel_token = otel_context.attach(otel_context.Context())
        try:
            with structlog.contextvars.bound_contextvars(request_id=request_id):
                await self.app(scope, receive, send_with_id)
        finally:
            otel_context.detach(otel_token)
            _current.reset(token)


def with_request_ids(app: Litestar) -> Litestar:
    """`app` with `RequestIdMiddleware` outside its whole ASGI stack (exception handling, the
    OpenTelemetry middleware, routing), where Litestar's own middleware would miss what routing
    refuses (a 404 of an unknown path, a 405)."""
    app.asgi_handler = RequestIdMiddleware(app.asgi_handler)
    return app
