"""Route of the legacy `POST /v1/completions`: a thin handler over `CompletionServing`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litestar import Request, Response, post

from gateway.api.http.disconnect import unless_client_leaves
from gateway.api.openai.completions.protocol import Completion, CompletionRequest
from gateway.api.openai.completions.serving import CompletionServing
from gateway.api.openai.replies import ERRORS, MiB, owner_of, reply

if TYPE_CHECKING:
    from gateway.server.state import GatewayState

__all__ = ("completions_route_handlers",)

MAX_COMPLETIONS_BODY = 16 * MiB  # text and token ids only


def completions_route_handlers(state: GatewayState) -> list[Any]:
    """The legacy completions handler, for the `/v1` router."""
    completions = CompletionServing(state)

    @post(
        "/completions",
        status_code=200,
        request_max_body_size=MAX_COMPLETIONS_BODY,
        responses=ERRORS,
        summary="Create a text completion (legacy; plain-text prompts, no chat template)",
    )
    async def create_completion(request: Request, data: CompletionRequest) -> Response[Completion]:
        work = completions.create(data, owner=owner_of(state, request))
        return reply(await unless_client_leaves(request.receive, work, route="completions"), state)

    return [create_completion]
