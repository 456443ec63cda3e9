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
- `response.steer`: user input (text, images) queued for the continuation of a response on this
  connection, its images encoding from the moment it is accepted (`steering`):
  `response.steer.accepted`, then a successor response when the target completes, or
  `response.steer.pending` when it stopped for its function calls' results (the input then
  goes before the next `response.create` that continues it), or `response.steer.failed`.

Anything that goes wrong with an event is an `error` event (`{"type": "error", "error":
{type, code, message, param}, "status"}`, the HTTP status the route would have answered) and
the connection stays open. Closing the connection cancels the response in progress.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from gateway.api.openai.chat import protocol as p
from gateway.api.openai.responses import protocol as r
from gateway.api.openai.responses.inputs import decode_request
from gateway.api.openai.responses.steering import Steer, SteerQueue, SteerRefused
from gateway.protocol.errors import GatewayError, error_response

if TYPE_CHECKING:
    from litestar import WebSocket

    from gateway.api.openai.responses.serving import ResponsesServing

__all__ = ("CLOSE_POLICY", "MAX_QUEUED", "ResponsesSocket")

log = structlog.get_logger("visiongate.http")

CLOSE_POLICY = 1008  # WebSocket close code: the key is refused (policy violation)
MAX_QUEUED = 8  # response.create events waiting behind the one in progress
ENDED_KEPT = 64  # responses of the connection whose end a steer may still name
_json = msgspec.json.Encoder()
_object = msgspec.json.Decoder(dict[str, Any])
# the envelope of `response.create` beside the create parameters
_ENVELOPE = ("type", "stream_id", "generate", "stream")


class _Job(msgspec.Struct):
    request: r.ResponsesRequest
    stream_id: str | None
    response_id: str | None = None  # known at its response.created
    cancelled: bool = False  # a cancel that came before response.created
    final: r.ResponseObject | None = None  # as its last event gave it
    steers: list[Any] = []  # the steers whose input it carries (`Steer`)


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
        self.steers = SteerQueue(serving.state, owner)
        # response id -> "waiting" (stopped for its calls' results) or "done"
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._waiting_calls: dict[str, list[r.FunctionCall]] = {}
        self._lanes: dict[str, str | None] = {}

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
                try:
                    await self._on_message(data)
                except GatewayError as exc:  # e.g. busy while the model loads
                    await self.error(exc)
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
            await self._steer(event)
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

    async def _steer(self, event: dict[str, Any]) -> None:
        target, value = event.get("previous_response_id"), event.get("input", "")
        if not isinstance(target, str) or not target:
            await self._steer_failed(
                "invalid_input", "previous_response_id names the response to steer", value, ""
            )
            return
        if not self._active(target) and target not in self._ended:
            await self._steer_failed(
                "response_not_found", "no such response on this connection", value, target
            )
            return
        if self._ended.get(target) == "done":
            await self._steer_failed(
                "response_already_completed", "the response has ended", value, target
            )
            return
        try:
            steer = await self.steers.accept(target, value)
        except SteerRefused as exc:
            await self._steer_failed(exc.code, exc.message, value, target)
            return
        stream_id = self._stream_of(target)
        await self._steer_event("response.steer.accepted", steer, stream_id)
        if self._active(target):
            return  # its end decides (`_on_end`)
        if self._ended.get(target) == "waiting":
            calls = self._waiting_calls.get(target, [])
            await self._steer_pending(steer, calls, stream_id)
            return
        self.steers.take(target)  # it ended while the steer was being checked
        await self._steer_failed(
            "response_already_completed", "the response has ended", value, target, steer.id
        )

    def _active(self, response_id: str) -> bool:
        job = self._current
        return job is not None and job.response_id == response_id and job.final is None

    def _stream_of(self, response_id: str) -> str | None:
        job = self._current
        if job is not None and job.response_id == response_id:
            return job.stream_id
        return self._lanes.get(response_id)

    async def _on_end(self, job: _Job) -> None:
        """A response of this connection ended: its steers' fate (see `steering`)."""
        final = job.final
        if final is None or job.response_id is None:
            return
        target = job.response_id
        calls = [item for item in final.output if isinstance(item, r.FunctionCall)]
        waiting = final.status == "completed" and bool(calls)
        self._remember(target, "waiting" if waiting else "done", calls, job.stream_id)
        if waiting:
            for steer in self.steers.queued(target):
                await self._steer_pending(steer, calls, job.stream_id)
            return
        steers = self.steers.take(target)
        if not steers:
            return
        if final.status != "completed":
            for steer in steers:
                await self._steer_failed(
                    "response_not_active",
                    f"the response ended {final.status}; send the input in a response.create",
                    steer.input,
                    target,
                    steer.id,
                )
            return
        # the successor: the target's settings, continuing it with the queued input
        request = msgspec.structs.replace(
            job.request,
            input=[item for steer in steers for item in steer.items],
            previous_response_id=target,
            prompt_cache_options=None,
        )
        await self._answer(_Job(request, job.stream_id, steers=steers))

    def _remember(
        self, response_id: str, how: str, calls: list[r.FunctionCall], stream_id: str | None
    ) -> None:
        self._ended[response_id] = how
        self._waiting_calls[response_id] = calls
        self._lanes[response_id] = stream_id
        while len(self._ended) > ENDED_KEPT:
            gone, _ = self._ended.popitem(last=False)
            self._waiting_calls.pop(gone, None)
            self._lanes.pop(gone, None)
            for steer in self.steers.take(gone):
                for task in steer.encodes:
                    task.cancel()

    async def _steer_event(self, kind: str, steer: Steer, stream_id: str | None) -> None:
        event: dict[str, Any] = {
            "type": kind,
            "sequence_number": 0,
            "steer": {"id": steer.id, "previous_response_id": steer.target},
        }
        if stream_id is not None:
            event["stream_id"] = stream_id
        await self.send(_json.encode(event))

    async def _steer_pending(
        self, steer: Steer, calls: list[r.FunctionCall], stream_id: str | None
    ) -> None:
        event: dict[str, Any] = {
            "type": "response.steer.pending",
            "sequence_number": 0,
            "reason": "waiting_for_required_input",
            "required_input": [
                {"type": "function_call_output", "call_id": call.call_id, "name": call.name}
                for call in calls
            ],
            "steer": {"id": steer.id, "previous_response_id": steer.target},
        }
        if stream_id is not None:
            event["stream_id"] = stream_id
        await self.send(_json.encode(event))

    async def _steer_failed(
        self, code: str, message: str, value: Any, target: str, steer_id: str | None = None
    ) -> None:
        steer: dict[str, Any] = {"input": value, "previous_response_id": target}
        if steer_id is not None:
            steer["id"] = steer_id
        event: dict[str, Any] = {
            "type": "response.steer.failed",
            "sequence_number": 0,
            "error": {"type": "invalid_request_error", "code": code, "message": message},
            "steer": steer,
        }
        stream_id = self._stream_of(target) if target else None
        if stream_id is not None:
            event["stream_id"] = stream_id
        await self.send(_json.encode(event))

    # ------------------------------------------------------------ answering

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            try:
                await self._answer(job)
            except GatewayError as exc:
                await self.error(exc, job.stream_id)
            except Exception:  # a fault of this response's: the connection goes on
                log.exception("responses_socket_fault", response_id=job.response_id)
                fault = GatewayError("internal_error", "the response failed; see the logs")
                await self.error(fault, job.stream_id)
            finally:
                self._current = None

    async def _answer(self, job: _Job) -> None:
        self._current = job
        previous = job.request.previous_response_id
        if not job.steers and previous is not None and self._ended.get(previous) == "waiting":
            # input steered while its results were due goes first, in the order it came
            job.steers = self.steers.take(previous)
            if job.steers:
                own = job.request.input
                own = [{"role": "user", "content": own}] if isinstance(own, str) else own
                queued = [item for steer in job.steers for item in steer.items]
                job.request = msgspec.structs.replace(job.request, input=[*queued, *own])

        def wire(event: r.ResponseEvent) -> bytes:
            if isinstance(event, r.ResponseCreated):
                job.response_id = event.response.id
                if job.cancelled:
                    self.serving.in_flight.signal(job.response_id, self.owner)
            elif isinstance(event, r.ResponseCompleted | r.ResponseIncomplete | r.ResponseFailed):
                job.final = event.response
            data = _json.encode(event)
            if job.stream_id is None:
                return data
            return b'{"stream_id":' + _json.encode(job.stream_id) + b"," + data[1:]

        answer = await self.serving.create(job.request, owner=self.owner, wire=wire)
        if isinstance(answer, p.ErrorResponse):
            await self._send_error(answer, job.stream_id)
            for steer in job.steers:  # their input was not committed
                await self._steer_failed(
                    "successor_creation_failed",
                    answer.error.message,
                    steer.input,
                    steer.target,
                    steer.id,
                )
            return
        if isinstance(answer, r.ResponseObject):  # not streamed: never, stream is set above
            return
        async with contextlib.aclosing(answer.frames) as frames:
            async for data in frames:
                await self.send(data)
        await self._on_end(job)

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
