"""Stable error codes: the one vocabulary for WebSocket `error` events and HTTP error bodies."""

from __future__ import annotations

from msgspec import Struct

__all__ = ("ERROR_CODES", "ErrorBody", "ErrorResponse", "GatewayError", "clip", "error_response")

# code -> (error type, HTTP status)
ERROR_CODES: dict[str, tuple[str, int]] = {
    "invalid_json": ("invalid_request_error", 400),
    "unknown_event": ("invalid_request_error", 400),
    "invalid_event": ("invalid_request_error", 400),
    "invalid_request": ("invalid_request_error", 400),
    "request_too_large": ("invalid_request_error", 413),
    "model_not_found": ("invalid_request_error", 404),
    "invalid_image": ("invalid_request_error", 400),
    "unsupported_image_format": ("invalid_request_error", 415),
    "image_too_large": ("invalid_request_error", 413),
    "image_not_found": ("invalid_request_error", 404),
    "image_fetch_failed": ("invalid_request_error", 400),
    "too_many_images": ("invalid_request_error", 400),
    "input_too_large": ("invalid_request_error", 413),
    "context_length_exceeded": ("invalid_request_error", 400),
    "response_in_progress": ("invalid_request_error", 409),
    "response_not_found": ("invalid_request_error", 404),
    "item_not_found": ("invalid_request_error", 404),
    # a `previous_response_id` that names no stored response: a bad value, 400 as OpenAI's
    "previous_response_not_found": ("invalid_request_error", 400),
    "session_not_found": ("invalid_request_error", 404),
    "unauthorized": ("authentication_error", 401),
    # a managed API key (gateway.policy.key_store) that was revoked, or is past its expires_at
    "api_key_revoked": ("authentication_error", 401),
    "api_key_expired": ("authentication_error", 401),
    # a key that is valid but may not do this: the admin API with a normal key, a model the
    # key is not allowed
    "permission_denied": ("permission_error", 403),
    "api_key_not_found": ("invalid_request_error", 404),
    "rate_limited": ("rate_limit_error", 429),
    # an API key with as many responses in flight as it may have at once (Retry-After)
    "concurrency_limited": ("rate_limit_error", 429),
    # a client that sent too many wrong admin keys in a row, for a doubling delay (Retry-After)
    "auth_locked_out": ("rate_limit_error", 429),
    # a request head or body that did not arrive in time (gateway/server/connection_guard.py)
    "request_timeout": ("invalid_request_error", 408),
    "busy": ("server_error", 503),
    "answer_not_stored": ("server_error", 503),
    "engine_error": ("server_error", 500),
    # an upstream replica (--engine openai) failed: an error after the answer began streaming,
    # a refusal of the gateway's own request (401/403/404), or every replica unreachable
    "upstream_error": ("server_error", 502),
    "internal_error": ("server_error", 500),
}


class GatewayError(Exception):
    """A request the gateway refuses, with a stable `code` (a key of ERROR_CODES)."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown error code {code!r}")
        message = clip(message, 500)  # client strings it quotes stay bounded
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        # set when the engine's queue is full: HTTP answers 429 with Retry-After (a model
        # still loading stays 503)
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        return ERROR_CODES[self.code][0]

    @property
    def http_status(self) -> int:
        if self.retry_after_s is not None and self.code == "busy":
            return 429
        return ERROR_CODES[self.code][1]


def clip(text: object, limit: int = 200) -> str:
    """``text`` as it may appear in an error message, a log line or a span: unchanged when it
    has at most ``limit`` characters, else its first ``limit`` characters, ``...`` and its length
    (a client string of any size becomes a bounded one)."""
    text = text if isinstance(text, str) else str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"


# ---------------------------------------------------------------- the HTTP error body


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct, omit_defaults=True):
    """`{"error": {"message", "type", "param", "code"}}` as OpenAI sends it, plus the status.

    `retry_after` (seconds) is set when the engine's queue is full: the answer is then 429 with
    a `Retry-After` header rather than the 503 of a model still loading."""

    error: ErrorBody
    retry_after: int | None = None

    @property
    def status_code(self) -> int:
        if self.retry_after is not None and self.error.code == "busy":
            return 429
        return ERROR_CODES.get(self.error.code or "", ("", 500))[1]


def error_response(exc: GatewayError) -> ErrorResponse:
    retry = None if exc.retry_after_s is None else max(1, round(exc.retry_after_s))
    return ErrorResponse(
        ErrorBody(message=exc.message, type=exc.type, param=exc.param, code=exc.code),
        retry_after=retry,
    )
