"""Routes of the Responses API (`/v1/responses`): thin handlers over `ResponsesServing`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litestar import Request, Response, WebSocket, delete, get, post, websocket

from gateway.api.http.disconnect import unless_client_leaves
from gateway.api.openai.replies import ERRORS, owner_of, reply, session_body_limit
from gateway.api.openai.responses import protocol as r
from gateway.api.openai.responses.inputs import decode_request
from gateway.api.openai.responses.serving import ResponsesServing
from gateway.api.openai.responses.websocket import CLOSE_POLICY, ResponsesSocket
from gateway.policy.key_guard import watch_key
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.server.state import GatewayState

__all__ = ("responses_route_handlers",)


def responses_route_handlers(state: GatewayState) -> list[Any]:
    """POST/GET/DELETE `/responses[/{id}]`, POST `/responses/{id}/cancel`, GET
    `/responses/{id}/input_items` and the WebSocket at `/responses`, for the `/v1` router."""
    responses = ResponsesServing(state)

    @post(
        "/responses",
        status_code=200,
        request_max_body_size=session_body_limit(state),  # images inline, as in chat
        responses=ERRORS,
        summary="Create a response (OpenAI Responses API; SSE events when stream)",
        description="`input` is a string or items: messages with `input_text` and "
        "`input_image` parts (data URLs, allow-listed URLs or `visiongate:sha256:<digest>`), "
        "and the history of function calls. `previous_response_id` continues a stored "
        "response's conversation, with its vision and KV caches.",
    )
    async def create_response(request: Request) -> Response[Any]:
        caller = owner_of(state, request)
        # decoded here, so that a refusal names the field (an unknown one too)
        data = decode_request(await request.body())
        work = responses.create(data, owner=caller)
        return reply(await unless_client_leaves(request.receive, work, route="responses"), state)

    @get("/responses/{response_id:str}", responses=ERRORS, summary="A stored response")
    async def get_response(
        request: Request, response_id: str, stream: bool = False
    ) -> Response[Any]:
        caller = owner_of(state, request)
        if stream:
            raise GatewayError(
                "invalid_request", "a stored response is not streamed again", param="stream"
            )
        body = await responses.retrieve(response_id, caller)
        if isinstance(body, bytes):  # the stored JSON, sent as it is
            return Response(body, status_code=200, media_type="application/json")
        return reply(body, state)

    @delete(
        "/responses/{response_id:str}",
        status_code=200,
        responses=ERRORS,
        summary="Delete a stored response",
    )
    async def delete_response(request: Request, response_id: str) -> Response[r.ResponseDeleted]:
        return reply(await responses.delete(response_id, owner_of(state, request)), state)

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
        caller = owner_of(state, request)
        page = await responses.input_items(
            response_id, caller, after=after, limit=limit, order=order
        )
        return reply(page, state)

    @post(
        "/responses/{response_id:str}/cancel",
        status_code=200,
        responses=ERRORS,
        summary="Cancel a response in progress",
        description="Stops a response this gateway is answering now (streamed or not, over "
        "HTTP or WebSocket) and returns it as stored once it ended (status `cancelled`).",
    )
    async def cancel_response(request: Request, response_id: str) -> Response[Any]:
        body = await responses.cancel(response_id, owner_of(state, request))
        if isinstance(body, bytes):
            return Response(body, status_code=200, media_type="application/json")
        return reply(body, state)

    @websocket("/responses")
    async def responses_socket(socket: WebSocket) -> None:
        offered = socket.scope.get("subprotocols") or []
        try:
            owner = state.auth.owner(socket.headers, offered)
        except GatewayError as exc:
            await socket.close(code=CLOSE_POLICY, reason=exc.message)
            return
        await socket.accept()
        connection = ResponsesSocket(socket, responses, owner, session_body_limit(state))

        async def key_refused(exc: GatewayError) -> None:  # revoked or expired while open
            await connection.error(exc)
            await socket.close(code=CLOSE_POLICY, reason=exc.code)

        async with watch_key(state.auth, socket.headers, offered, key_refused):
            await connection.run()

    return [
        create_response,
        get_response,
        delete_response,
        cancel_response,
        list_input_items,
        responses_socket,
    ]
