"""The `/v1` router: every OpenAI-compatible API's routes, the resources', and the playground.

Each API has its own routes (`chat/router.py`, `responses/router.py`, `completions/router.py`),
thin handlers over its serving object; this module adds the resources (models, images,
sessions, over `resources.py`), mounts them all under `/v1` with one exception handler, and
serves the playground page at `/`. Everything that goes wrong before a handler runs (malformed
JSON, a body that fails validation, a body too large) is turned into the same OpenAI error
object (`gateway.api.http.error_replies`), so clients see one error shape everywhere under `/v1`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from litestar import Request, Response, Router, delete, get, post
from litestar.datastructures import UploadFile
from litestar.static_files import create_static_files_router

from gateway.api.http.error_replies import error_handler
from gateway.api.openai.chat import protocol as p
from gateway.api.openai.chat.router import chat_route_handlers
from gateway.api.openai.completions.router import completions_route_handlers
from gateway.api.openai.replies import ERRORS, MiB, owner_of, reply
from gateway.api.openai.resources import ImageServing, ModelServing, SessionServing
from gateway.api.openai.responses.router import responses_route_handlers
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.server.state import GatewayState

__all__ = ("STATIC_DIR", "http_route_handlers", "routing_error_handler")

STATIC_DIR = Path(__file__).resolve().parents[2] / "server" / "static"


def http_route_handlers(state: GatewayState) -> list[Any]:
    """The `/v1` HTTP API (chat completions, responses, completions, models, images, sessions)
    and the playground at `/`."""
    settings = state.settings
    models = ModelServing(state)
    images = ImageServing(state)
    sessions = SessionServing(state)

    def owner(request: Request) -> str:
        return owner_of(state, request)  # GatewayError -> 401

    @get("/models", sync_to_thread=False, summary="List the served model")
    def list_models(request: Request) -> p.ModelList:
        owner(request)
        return models.list()

    @get("/models/{model:str}", sync_to_thread=False, responses=ERRORS, summary="Describe a model")
    def get_model(request: Request, model: str) -> Response[p.ModelCard]:
        owner(request)
        return reply(models.get(model), state)

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
        return reply(await images.upload(body, owner=caller, session_id=session_id), state)

    @get("/images/{digest:str}", responses=ERRORS, summary="Status of an uploaded image")
    async def image_status(request: Request, digest: str) -> Response[p.ImageStatus]:
        return reply(await images.status(digest, owner=owner(request)), state)

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
        return reply(
            await sessions.get(session_id, owner(request), after=after, limit=limit), state
        )

    @delete(
        "/sessions/{session_id:str}", status_code=200, responses=ERRORS, summary="Delete a session"
    )
    async def delete_session(request: Request, session_id: str) -> Response[p.SessionDeleted]:
        return reply(await sessions.delete(session_id, owner(request)), state)

    api = Router(
        path="/v1",
        tags=["OpenAI-compatible"],
        route_handlers=[
            *chat_route_handlers(state),
            *responses_route_handlers(state),
            *completions_route_handlers(state),
            list_models,
            get_model,
            upload_image,
            image_status,
            get_session,
            delete_session,
        ],
        exception_handlers={Exception: error_handler(state)},
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
    return error_handler(state)
