"""Routes of the OpenAI-compatible HTTP API and the playground:
thin handlers over the serving layer.

Handlers authenticate, hand the decoded request to a serving object, and map what comes back
to HTTP: an `ErrorResponse` gets the status of its code, a stream becomes `text/event-stream`.
Everything that goes wrong before a handler runs (malformed JSON, a body that fails
validation, a body too large) is turned into the same OpenAI error object by the router's
exception handlers, so clients see one error shape everywhere under `/v1`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import structlog
from litestar import Request, Response, Router, delete, get, post
from litestar.datastructures import UploadFile
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import Parameter
from litestar.response import Stream
from litestar.static_files import create_static_files_router

from gateway.api.openai.api_routes import more_route_handlers
from gateway.api.openai.chat import protocol as p
from gateway.api.openai.chat.serving import ChatCompletionServing
from gateway.api.openai.resources import ImageServing, ModelServing, SessionServing
from gateway.api.openai.serving import EventStream
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.server.state import GatewayState

__all__ = ("STATIC_DIR", "http_route_handlers", "routing_error_handler")

log = structlog.get_logger("visiongate.http")

STATIC_DIR = Path(__file__).resolve().parents[2] / "server" / "static"
MiB = 1024 * 1024
MAX_CHAT_BODY = 512 * MiB

ERRORS = {
    status: ResponseSpec(p.ErrorResponse, description=text)
    for status, text in (
        (400, "Invalid request"),
        (401, "Missing or unknown API key"),
        (404, "Not found"),
        (413, "Too large"),
        (415, "Unsupported image format"),
        (429, "Rate limited"),
        (503, "Loading or busy"),
    )
}


def http_route_handlers(state: GatewayState) -> list[Any]:
    """The `/v1` HTTP API (chat completions, models, images, sessions) and the playground at `/`."""
    settings = state.settings
    chat = ChatCompletionServing(state)
    models = ModelServing(state)
    images = ImageServing(state)
    sessions = SessionServing(state)
    # OpenAI clients resend every image on every turn: room for a full session of images
    chat_body_limit = min(
        MAX_CHAT_BODY, settings.max_image_bytes * 4 // 3 * settings.max_images_per_session + 4 * MiB
    )

    def owner(request: Request) -> str:
        return state.auth.owner(request.headers)  # GatewayError -> 401

    def reply(value: Any, **headers: str) -> Response[Any]:
        if isinstance(value, p.ErrorResponse):
            return error_reply(value, state)
        return Response(value, status_code=200, headers=headers or None)

    @post(
        "/chat/completions",
        status_code=200,
        request_max_body_size=chat_body_limit,
        responses=ERRORS,
        summary="Create a chat completion (OpenAI format; SSE when stream)",
        description="Messages may hold `image_url` parts with data URLs or "
        "`visiongate:sha256:<digest>` references. `session_id` (body) or `X-Session-Id` joins "
        "a session, so its KV and vision caches carry across requests.",
    )
    async def chat_completions(
        request: Request,
        data: p.ChatCompletionRequest,
        x_session_id: Annotated[
            str | None, Parameter(header="x-session-id", required=False)
        ] = None,
    ) -> Response[p.ChatCompletion]:
        # the request's ASGI channel: a client gone before its answer is sent cancels it
        result = await chat.create(
            data, owner=owner(request), session_id=x_session_id, receive=request.receive
        )
        if isinstance(result, EventStream):
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            if result.session_id:
                headers["X-Session-Id"] = result.session_id
            return Stream(result.frames, media_type="text/event-stream", headers=headers)
        if (
            isinstance(result, p.ChatCompletion)
            and result.visiongate
            and result.visiongate.session_id
        ):
            return reply(result, **{"X-Session-Id": result.visiongate.session_id})
        return reply(result)

    @get("/models", sync_to_thread=False, summary="List the served model")
    def list_models(request: Request) -> p.ModelList:
        owner(request)
        return models.list()

    @get("/models/{model:str}", sync_to_thread=False, responses=ERRORS, summary="Describe a model")
    def get_model(request: Request, model: str) -> Response[p.ModelCard]:
        owner(request)
        return reply(models.get(model))

    @post(
        "/images",
        status_code=200,
        request_max_body_size=settings.max_image_bytes * 2 + MiB,
        responses=ERRORS,
        summary="Upload an image and start encoding it",
        description="The body is the raw image bytes (`Content-Type: image/*`) or a multipart "
        "form with a `file` field. Returns the digest; reference the image in chat messages as "
        '`image_url.url = "visiongate:sha256:<digest>"`.',
    )
    async def upload_image(request: Request) -> Response[p.ImageStatus]:
        caller = owner(request)
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            form = await request.form()
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                upload = next((v for v in form.values() if isinstance(v, UploadFile)), None)
            if upload is None:
                raise GatewayError("invalid_request", "the form holds no file", param="file")
            body = await upload.read()
        else:
            body = await request.body()
        # a session whose next turn sends this image: its KV is warmed up meanwhile
        session_id = request.query_params.get("session_id") or request.headers.get("x-session-id")
        return reply(await images.upload(body, owner=caller, session_id=session_id))

    @get("/images/{digest:str}", responses=ERRORS, summary="Status of an uploaded image")
    async def image_status(request: Request, digest: str) -> Response[p.ImageStatus]:
        return reply(await images.status(digest, owner=owner(request)))

    @get(
        "/sessions/{session_id:str}",
        responses=ERRORS,
        summary="A session's conversation, a page at a time",
        description="`limit` items (default and most 1000) after the item `after` (from the "
        "first when absent); `has_more` says whether more follow.",
    )
    async def get_session(
        request: Request, session_id: str, after: str | None = None, limit: int = 1000
    ) -> Response[p.SessionView]:
        return reply(await sessions.get(session_id, owner(request), after=after, limit=limit))

    @delete(
        "/sessions/{session_id:str}", status_code=200, responses=ERRORS, summary="Delete a session"
    )
    async def delete_session(request: Request, session_id: str) -> Response[p.SessionDeleted]:
        return reply(await sessions.delete(session_id, owner(request)))

    def on_error(request: Request, exc: Exception) -> Response[p.ErrorResponse]:
        # Litestar's own refusals (405, 413, ...) keep their status
        status = (
            exc.status_code if isinstance(exc, HTTPException) and exc.status_code < 500 else None
        )
        return error_reply(p.error_response(as_gateway_error(exc)), state, status=status)

    api = Router(
        path="/v1",
        tags=["OpenAI-compatible"],
        route_handlers=[
            chat_completions,
            list_models,
            get_model,
            upload_image,
            image_status,
            get_session,
            delete_session,
            *more_route_handlers(state),
        ],
        exception_handlers={Exception: on_error},
    )

    @get("/", include_in_schema=False, sync_to_thread=False)
    def playground() -> Response[bytes]:
        return Response((STATIC_DIR / "index.html").read_bytes(), media_type="text/html")

    static = create_static_files_router(
        path="/static", directories=[STATIC_DIR], include_in_schema=False
    )
    return [api, playground, static]


def routing_error_handler(state: GatewayState) -> Any:
    """The app's handler for what routing refuses before any router runs (a path that does not
    exist, a method a path does not take): the same OpenAI error object, the same status."""

    def on_routing_error(request: Request, exc: HTTPException) -> Response[p.ErrorResponse]:
        status = exc.status_code if exc.status_code < 500 else None
        return error_reply(p.error_response(as_gateway_error(exc)), state, status=status)

    return on_routing_error


def as_gateway_error(exc: Exception) -> GatewayError:
    """Anything raised under /v1 -> a GatewayError with a stable code."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, RecursionError) or isinstance(exc.__cause__, RecursionError):
        return GatewayError("invalid_json", "the body is nested too deeply")
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


def error_reply(
    error: p.ErrorResponse, state: GatewayState, *, status: int | None = None
) -> Response[p.ErrorResponse]:
    if error.error.code:
        state.metrics.record_error(code=error.error.code, api="http")
    log.info(
        "client_error",
        api="http",
        code=error.error.code,
        message=error.error.message,
        param=error.error.param,
    )
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return Response(error, status_code=status or error.status_code, headers=headers)
