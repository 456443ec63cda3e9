"""Routes of the Responses API (`/v1/responses`) and the legacy `/v1/completions`: thin
handlers over their serving objects, in the same `/v1` router as chat completions.

A refusal the serving layer returns is raised again as its `GatewayError`, so that the router's
one exception handler answers it (the OpenAI error shape, its status, `Retry-After`, the error
metric), as it answers every other error under `/v1`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litestar import Request, Response, delete, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.response import Stream

from gateway.api.http.disconnect import unless_client_leaves
from gateway.api.openai.chat import protocol as p
from gateway.api.openai.completions.protocol import Completion, CompletionRequest
from gateway.api.openai.completions.serving import CompletionServing
from gateway.api.openai.responses import protocol as r
from gateway.api.openai.responses.serving import ResponsesServing
from gateway.api.openai.serving import EventStream
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.server.state import GatewayState

__all__ = ("more_route_handlers",)

MiB = 1024 * 1024
MAX_RESPONSES_BODY = 512 * MiB
MAX_COMPLETIONS_BODY = 16 * MiB
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ERRORS = {
    status: ResponseSpec(p.ErrorResponse, description=text)
    for status, text in (
        (400, "Invalid request"),
        (401, "Missing or unknown API key"),
        (404, "Not found"),
        (413, "Too large"),
        (429, "Rate limited"),
        (503, "Loading or busy"),
    )
}


def more_route_handlers(state: GatewayState) -> list[Any]:
    """POST/GET/DELETE `/responses[/{id}]`, GET `/responses/{id}/input_items` and POST
    `/completions`, for the `/v1` router."""
    settings = state.settings
    responses = ResponsesServing(state)
    completions = CompletionServing(state)
    # a request carries its images inline, as a chat request does
    responses_body_limit = min(
        MAX_RESPONSES_BODY,
        settings.max_image_bytes * 4 // 3 * settings.max_images_per_session + 4 * MiB,
    )

    def owner(request: Request) -> str:
        return state.auth.owner(request.headers)  # GatewayError -> 401

    def reply(value: Any) -> Response[Any]:
        if isinstance(value, p.ErrorResponse):
            raise refusal(value)
        if isinstance(value, EventStream):
            headers = dict(STREAM_HEADERS)
            if value.session_id:
                headers["X-Session-Id"] = value.session_id
            return Stream(value.frames, media_type="text/event-stream", headers=headers)
        return Response(value, status_code=200)

    @post(
        "/responses",
        status_code=200,
        request_max_body_size=responses_body_limit,
        responses=ERRORS,
        summary="Create a response (OpenAI Responses API; SSE events when stream)",
        description="`input` is a string or items: messages with `input_text` and "
        "`input_image` parts (data URLs, allow-listed URLs or `visiongate:sha256:<digest>`), "
        "and the history of function calls. `previous_response_id` continues a stored "
        "response's conversation, with its vision and KV caches.",
    )
    async def create_response(request: Request) -> Response[Any]:
        caller = owner(request)
        # decoded here, so that a refusal names the field (an unknown one too)
        data = r.decode_request(await request.body())
        work = responses.create(data, owner=caller)
        return reply(await unless_client_leaves(request.receive, work, route="responses"))

    @get(
        "/responses/{response_id:str}",
        responses=ERRORS,
        summary="A stored response",
    )
    async def get_response(
        request: Request, response_id: str, stream: bool = False
    ) -> Response[Any]:
        caller = owner(request)
        if stream:
            raise GatewayError(
                "invalid_request", "a stored response is not streamed again", param="stream"
            )
        body = await responses.retrieve(response_id, caller)
        if isinstance(body, p.ErrorResponse):
            raise refusal(body)
        return Response(body, status_code=200, media_type="application/json")

    @delete(
        "/responses/{response_id:str}",
        status_code=200,
        responses=ERRORS,
        summary="Delete a stored response",
    )
    async def delete_response(request: Request, response_id: str) -> Response[r.ResponseDeleted]:
        return reply(await responses.delete(response_id, owner(request)))

    @get(
        "/responses/{response_id:str}/input_items",
        responses=ERRORS,
        summary="A stored response's input items, a page at a time",
    )
    async def list_input_items(
        request: Request,
        response_id: str,
        after: str | None = None,
        limit: int = 20,
        order: str = "desc",
    ) -> Response[r.InputItemList]:
        caller = owner(request)
        page = await responses.input_items(
            response_id, caller, after=after, limit=limit, order=order
        )
        return reply(page)

    @post(
        "/completions",
        status_code=200,
        request_max_body_size=MAX_COMPLETIONS_BODY,
        responses=ERRORS,
        summary="Create a text completion (legacy; plain-text prompts, no chat template)",
    )
    async def create_completion(request: Request, data: CompletionRequest) -> Response[Completion]:
        work = completions.create(data, owner=owner(request))
        return reply(await unless_client_leaves(request.receive, work, route="completions"))

    return [create_response, get_response, delete_response, list_input_items, create_completion]


def refusal(error: p.ErrorResponse) -> GatewayError:
    """The GatewayError an error response was made from."""
    body = error.error
    return GatewayError(
        body.code or "internal_error",
        body.message,
        param=body.param,
        retry_after_s=error.retry_after,
    )
