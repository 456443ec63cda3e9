"""`/v1/responses` over WebSocket: the Responses API's WebSocket mode, as the official SDK's
`client.responses.connect()` speaks it.

The handshake carries the API key as HTTP does (`Authorization: Bearer`); a missing or wrong
one closes the socket before it opens (1008, the reason says why); an ephemeral key is refused
(it opens Realtime sessions only). While the connection is open its managed key is watched, as
a Realtime connection's is: revoked or expired, the connection gets an `error` and closes 1008.

Client events, one JSON object per text message:

- `response.create`: the create parameters of `POST /v1/responses` (less `stream`, which is
  implied, and `background`, refused as over HTTP), plus `stream_id`, echoed on every event of
  that response, and `generate: false`, which is `prompt_cache_options.prewarm`. Each goes
  through `ResponsesServing.create`, so the request layer, keys, rate and token limits and
  tenancy are the HTTP route's, and its events are the SSE stream's, one per message. The
  connection answers its responses one at a time in the order they came (up to `MAX_QUEUED`
  waiting; one past that is refused with `response_in_progress`). `previous_response_id` chains
  are the stored sessions of HTTP: the vision and KV caches carry over from response to
  response, on this connection or any other of the same key.
- `response.cancel` (visiongate's, as in the Realtime API; `response_id` optional): the
  response in progress stops within one decode step and ends with `response.incomplete`,
  status `cancelled`, its partial answer kept. The SDK sends it with
  `connection.send({"type": "response.cancel"})`. `POST /v1/responses/{id}/cancel`
  (`client.responses.cancel(id)`) cancels it too, from anywhere.
- `response.steer`: refused with `response.steer.failed`, code `steering_not_supported` (the
  input comes back, to send in the next `response.create`).

Anything that goes wrong with an event is an `error` event (`{"type": "error", "error":
{type, code, message, param}, "status"}`, the HTTP status the route would have answered) and
the connection stays open. Closing the connection cancels the response in progress.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from gateway.api.openai.chat import protocol as p
from gateway.api.openai.responses import protocol as r
from gateway.api.openai.responses.inputs import decode_request
from gateway.protocol.errors import GatewayError, error_response

if TYPE_CHECKING:
    from litestar import WebSocket

    from gateway.api.openai.responses.serving import ResponsesServing

__all__ = ("MAX_QUEUED", "ResponsesSocket")

log = structlog.get_logger("visiongate.http")

MAX_QUEUED = 8  # response.create events waiting behind the one in progress
_json = msgspec.json.Encoder()
_object = msgspec.json.Decoder(dict[str, Any])
# the envelope of `response.create` beside the create parameters
_ENVELOPE = ("type", "stream_id", "generate", "stream")


class _Job(msgspec.Struct):
    request: r.ResponsesRequest
    stream_id: str | None
    response_id: str | None = None  # known at its response.created
    cancelled: bool = False  # a cancel that came before response.created


class ResponsesSocket:
    """One open `/v1/responses` WebSocket of `owner`'s: reads client events, answers its
    responses one at a time (see the module doc)."""

    def __init__(
        self, socket: WebSocket, serving: ResponsesServing, owner: str, max_message: int
    ) -> None:
        self.socket = socket
        self.serving = serving
        self.owner = owner
        self.max_message = max_message
        self._queue: asyncio.Queue[_Job] = asyncio.Queue(MAX_QUEUED)
        self._current: _Job | None = None
        self._send_lock = asyncio.Lock()
        self._closed = False

    async def run(self) -> None:
        worker = asyncio.create_task(self._work())
        try:
            while True:
                message = await self.socket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                data = message.get("text")
                if data is None:
                    data = message.get("bytes") or b""
                await self._on_message(data)
        except Exception as exc:  # the socket failed: nothing left to answer
            log.info("responses_socket_ended", error=type(exc).__name__)
        finally:
            self._closed = True
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)

    # ------------------------------------------------------------ client events

    async def _on_message(self, data: str | bytes) -> None:
        size = len(data)
        if size > self.max_message:
            await self.error(
                GatewayError(
                    "request_too_large",
                    f"the event has {size} bytes; at most {self.max_message} are taken",
                )
            )
            return
        try:
            event = _object.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            await self.error(GatewayError("invalid_json", "the event is not a JSON object"))
            return
        kind = event.get("type")
        if kind == "response.create":
            await self._create(event)
        elif kind == "response.cancel":
            await self._cancel(event)
        elif kind == "response.steer":
            await self._refuse_steer(event)
        else:
            await self.error(
                GatewayError(
                    "unknown_event",
                    f"unknown event type {str(kind)[:64]!r}; this socket takes response.create, "
                    "response.cancel and response.steer",
                    param="type",
                )
            )

    async def _create(self, event: dict[str, Any]) -> None:
        stream_id = event.get("stream_id")
        if stream_id is not None and not isinstance(stream_id, str):
            refusal = GatewayError("invalid_request", "stream_id is a string", param="stream_id")
            await self.error(refusal)
            return
        generate = event.get("generate")
        if generate is not None and not isinstance(generate, bool):
            await self.error(
                GatewayError("invalid_request", "generate is true or false", param="generate"),
                stream_id,
            )
            return
        body = {k: v for k, v in event.items() if k not in _ENVELOPE}
        if generate is False:  # prepare the request's state without output: a prewarm
            cache = body.get("prompt_cache_options")
            cache = cache if isinstance(cache, dict) else {}
            body["prompt_cache_options"] = {**cache, "prewarm": True}
        try:
            request = decode_request(_json.encode(body))
        except GatewayError as exc:
            await self.error(exc, stream_id)
            return
        request.stream = True
        try:
            self._queue.put_nowait(_Job(request, stream_id))
        except asyncio.QueueFull:
            await self.error(
                GatewayError(
                    "response_in_progress",
                    f"{MAX_QUEUED} responses wait on this connection already; "
                    "wait for one to end, or open another connection",
                ),
                stream_id,
            )

    async def _cancel(self, event: dict[str, Any]) -> None:
        named = event.get("response_id")
        job = self._current
        if job is None or (named is not None and named != job.response_id):
            await self.error(
                GatewayError(
                    "response_not_found",
                    "no response in progress on this connection"
                    + (f" has id {str(named)[:64]!r}" if named is not None else ""),
                    param="response_id" if named is not None else None,
                )
            )
            return
        job.cancelled = True
        if job.response_id is not None:
            self.serving.in_flight.signal(job.response_id, self.owner)

    async def _refuse_steer(self, event: dict[str, Any]) -> None:
        await self.send(
            _json.encode(
                {
                    "type": "response.steer.failed",
                    "sequence_number": 0,
                    "error": {
                        "type": "invalid_request_error",
                        "code": "steering_not_supported",
                        "message": "steering is not supported: send the input in the next "
                        "response.create, with previous_response_id",
                    },
                    "steer": {
                        "input": event.get("input", ""),
                        "previous_response_id": str(event.get("previous_response_id", "")),
                    },
                }
            )
        )

    # ------------------------------------------------------------ answering

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            self._current = job
            try:
                await self._answer(job)
            finally:
                self._current = None

    async def _answer(self, job: _Job) -> None:
        def wire(event: r.ResponseEvent) -> bytes:
            if isinstance(event, r.ResponseCreated):
                job.response_id = event.response.id
                if job.cancelled:
                    self.serving.in_flight.signal(job.response_id, self.owner)
            data = _json.encode(event)
            if job.stream_id is None:
                return data
            return b'{"stream_id":' + _json.encode(job.stream_id) + b"," + data[1:]

        answer = await self.serving.create(job.request, owner=self.owner, wire=wire)
        if isinstance(answer, p.ErrorResponse):
            await self._send_error(answer, job.stream_id)
            return
        if isinstance(answer, r.ResponseObject):  # not streamed: never, stream is set above
            return
        async with contextlib.aclosing(answer.frames) as frames:
            async for data in frames:
                await self.send(data)

    # ------------------------------------------------------------ sending

    async def send(self, data: bytes) -> None:
        if self._closed:
            return
        async with self._send_lock:
            await self.socket.send_text(data.decode())

    async def error(self, exc: GatewayError, stream_id: str | None = None) -> None:
        await self._send_error(error_response(exc), stream_id)

    async def _send_error(self, answer: p.ErrorResponse, stream_id: str | None) -> None:
        body = answer.error
        event: dict[str, Any] = {
            "type": "error",
            "error": {
                "type": body.type,
                "code": body.code,
                "message": body.message,
                "param": body.param,
            },
            "status": answer.status_code,
        }
        if stream_id is not None:
            event["stream_id"] = stream_id
        await self.send(_json.encode(event))
