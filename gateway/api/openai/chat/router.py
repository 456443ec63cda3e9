"""Route of `POST /v1/chat/completions`: a thin handler over `ChatCompletionServing`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from litestar import Request, Response, post
from litestar.params import Parameter

from gateway.api.http.disconnect import unless_client_leaves
from gateway.api.openai.chat import protocol as p
from gateway.api.openai.chat.serving import ChatCompletionServing
from gateway.api.openai.replies import ERRORS, owner_of, reply, session_body_limit

if TYPE_CHECKING:
    from gateway.server.state import GatewayState

__all__ = ("chat_route_handlers",)


def chat_route_handlers(state: GatewayState) -> list[Any]:
    """The chat completions handler, for the `/v1` router."""
    chat = ChatCompletionServing(state)

    @post(
        "/chat/completions",
        status_code=200,
        request_max_body_size=session_body_limit(state),
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
        work = chat.create(data, owner=owner_of(state, request), session_id=x_session_id)
        # a client gone before its answer is sent cancels it (a stream: the server does)
        result = await unless_client_leaves(request.receive, work, route="chat")
        ext = result.visiongate if isinstance(result, p.ChatCompletion) else None
        return reply(result, state, session_id=ext.session_id if ext else None)

    return [chat_completions]
