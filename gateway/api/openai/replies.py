"""How every `/v1` handler answers: the caller's owner id, a serving value as HTTP, one error shape.

A serving object returns a value (`gateway.api.openai.serving`); `reply` maps it: an
`ErrorResponse` gets the status of its code (and `Retry-After` when it has one), an
`EventStream` becomes `text/event-stream` (with `X-Session-Id` when it joined a stored
session), anything else is a 200. Whatever is raised under `/v1` (a `GatewayError`, a body
Litestar could not decode or validate, a fault) is turned into the same OpenAI error object
(`gateway.api.http.error_replies`), so clients see one error shape everywhere; every error answer is
counted in the error metric and logged once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
from litestar import Request, Response
from litestar.openapi.datastructures import ResponseSpec

from gateway.api.http.error_replies import error_reply
from gateway.api.http.sse_stream import DirectStream
from gateway.api.openai.chat import protocol as p
from gateway.api.openai.serving import EventStream

if TYPE_CHECKING:
    from gateway.server.state import GatewayState

__all__ = (
    "ERRORS",
    "MiB",
    "owner_of",
    "reply",
    "session_body_limit",
)

log = structlog.get_logger("visiongate.http")

MiB = 1024 * 1024
MAX_SESSION_BODY = 512 * MiB
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# the error statuses a `/v1` route can answer, for the OpenAPI schema
ERRORS = {
    status: ResponseSpec(p.ErrorResponse, description=text)
    for status, text in (
        (400, "Invalid request"),
        (401, "Missing or unknown API key"),
        (403, "Not allowed for this API key"),
        (404, "Not found"),
        (413, "Too large"),
        (415, "Unsupported image format"),
        (429, "Rate limited"),
        (503, "Loading or busy"),
    )
}


def session_body_limit(state: GatewayState) -> int:
    """The body a conversation request may send: OpenAI clients resend every image on every
    turn, so room for a full session of images (base64) and its text."""
    settings = state.settings
    return min(
        MAX_SESSION_BODY,
        settings.max_image_bytes * 4 // 3 * settings.max_images_per_session + 4 * MiB,
    )


def owner_of(state: GatewayState, request: Request) -> str:
    """The owner id of the request's API key; GatewayError (401) without a valid one."""
    return state.auth.owner(request.headers)


def reply(value: Any, state: GatewayState, *, session_id: str | None = None) -> Response[Any]:
    """A serving value as its HTTP answer; `session_id` goes out as `X-Session-Id`."""
    if isinstance(value, p.ErrorResponse):
        return error_reply(value, state)
    if isinstance(value, EventStream):
        headers = dict(STREAM_HEADERS)
        if value.session_id:
            headers["X-Session-Id"] = value.session_id
        return DirectStream(value.frames, media_type="text/event-stream", headers=headers)
    headers = {"X-Session-Id": session_id} if session_id else None
    return Response(value, status_code=200, headers=headers)
