"""One error shape for every HTTP route: whatever a handler raises becomes the OpenAI error object.

`as_gateway_error` maps what is raised under a router (a `GatewayError`, a body Litestar could
not decode or validate, a refusal of Litestar's own, a fault) to a `GatewayError` with a stable
code; `error_reply` answers it (the status of its code, or Litestar's own for its refusals,
`Retry-After` when it has one, and 1 s on every 503), counts it in the error metric and logs
it once; `error_handler` is the two as a router's exception handler. The `/v1` router, the admin API
and the client-secret routes all answer errors through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException, InternalServerException, ValidationException

from gateway.protocol.errors import ErrorResponse, GatewayError, error_response

if TYPE_CHECKING:
    from gateway.server.state import GatewayState

__all__ = ("as_gateway_error", "error_handler", "error_reply")

log = structlog.get_logger("visiongate.http")

RETRY_AFTER_S = 1  # the Retry-After of a 503 that names none
# what Litestar's body reader (`Request.stream`) raises when the server reports the connection
# gone before the whole body came: the client left, or the connection guard cut a slow body off
# (gateway/server/connection_guard.py). Not a fault of the gateway's: nobody reads the answer.
_BODY_CUT_OFF = "client disconnected prematurely"


def error_reply(
    error: ErrorResponse, state: GatewayState, *, status: int | None = None, api: str = "http"
) -> Response[ErrorResponse]:
    """The HTTP answer of an error (`status`: Litestar's own for its refusals), counted and
    logged; `api` names the routes in the log line."""
    if error.error.code:
        state.metrics.record_error(code=error.error.code, api="http")
    log.info(
        "client_error",
        api=api,
        code=error.error.code,
        message=error.error.message,
        param=error.error.param,
    )
    code = status or error.status_code
    retry = error.retry_after
    if retry is None and code == 503:  # busy, loading, a store down: all worth retrying soon
        retry = RETRY_AFTER_S
    headers = {"Retry-After": str(retry)} if retry is not None else None
    return Response(error, status_code=code, headers=headers)


def as_gateway_error(exc: Exception) -> GatewayError:
    """Anything raised under /v1 -> a GatewayError with a stable code."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, RecursionError) or isinstance(exc.__cause__, RecursionError):
        return GatewayError("invalid_json", "the body is nested too deeply")
    if isinstance(exc, InternalServerException) and exc.detail == _BODY_CUT_OFF:
        # the same code as a client gone before its answer (gateway/api/http/disconnect.py)
        return GatewayError(
            "invalid_request", "the connection closed before the request body arrived"
        )
    if isinstance(exc, ValidationException):
        problems = exc.extra if isinstance(exc.extra, list) else []
        if problems and isinstance(problems[0], dict):
            first = problems[0]
            key = first.get("key") or None
            message = str(first.get("message", "invalid value"))
            return GatewayError(
                "invalid_request", f"{message}" + (f" at {key}" if key else ""), param=key
            )
        detail = str(exc.detail)
        code = "invalid_json" if "JSON" in detail else "invalid_request"
        return GatewayError(code, detail)
    if isinstance(exc, HTTPException):
        if exc.status_code == 413:
            return GatewayError("request_too_large", "the request body is too large")
        if exc.status_code == 400 and "JSON" in str(exc.detail):
            return GatewayError("invalid_json", str(exc.detail))
        if exc.status_code < 500:
            return GatewayError("invalid_request", str(exc.detail))
        return GatewayError("internal_error", str(exc.detail))
    log.error("http_handler_failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
    return GatewayError("internal_error", f"internal error: {type(exc).__name__}")


def error_handler(
    state: GatewayState, *, api: str = "http"
) -> Callable[[Request, Exception], Response[Any]]:
    """A router's exception handler: anything raised answered as the OpenAI error object."""

    def on_error(request: Request, exc: Exception) -> Response[Any]:
        # Litestar's own refusals (404, 405, 413, ...) keep their status
        status = (
            exc.status_code if isinstance(exc, HTTPException) and exc.status_code < 500 else None
        )
        return error_reply(error_response(as_gateway_error(exc)), state, status=status, api=api)

    return on_error
