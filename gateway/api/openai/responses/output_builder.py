"""The output of one Responses API response, built from the service's events.

`OutputBuilder` turns the service's text into the response's output items and the stream
events that add them: message items for text, function_call items for the calls the tools
grammar made (read as they stream, so a call's arguments go out as they are written). The
non-streamed answer is built the same way, so both give the same output. `frame` makes an
event one SSE frame (`event:` its type, `data:` its JSON).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from gateway.api.openai.chat import protocol as p
from gateway.api.openai.responses import protocol as r
from gateway.chat.tool_stream import ArgumentsPiece, CallStart, TextPiece, ToolCallStream
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.chat.events import Finished, ResponseOptions, TextChunk
    from gateway.engine.interface import TokenLogprob
    from gateway.sessions.session import Session

__all__ = ("OutputBuilder", "PreparedResponse", "frame", "mark_failed")

_json = msgspec.json.Encoder()

# visiongate's codes -> OpenAI's codes for a failed response (the stable code goes in `type`)
_FAILED_CODES = {
    "invalid_image": "invalid_image",
    "unsupported_image_format": "unsupported_image_media_type",
    "image_too_large": "image_too_large",
    "image_fetch_failed": "failed_to_download_image",
    "image_not_found": "image_file_not_found",
    "rate_limited": "rate_limit_exceeded",
    "concurrency_limited": "rate_limit_exceeded",
    "busy": "rate_limit_exceeded",
    "context_length_exceeded": "invalid_prompt",
    "input_too_large": "invalid_prompt",
    "invalid_request": "invalid_prompt",
}


class PreparedResponse(Protocol):
    """What the output of a response is built from: the serving layer's prepared response."""

    request: r.ResponsesRequest
    options: ResponseOptions
    session: Session
    stored: bool  # the session lives in the store
    forked: bool  # the response started a new branch of its chain
    notes: list[str]  # what of the request was ignored, said in the response's extension
    created_at: int
    model: str


class OutputBuilder:
    """Builds a response's output from the service's text, and the stream events that add it:
    message items for text, function_call items for the calls the tools grammar made (read as
    they stream, so a call's arguments go out as they are written). The non-streamed answer
    is built the same way, so both give the same output."""

    def __init__(self, prepared: PreparedResponse) -> None:
        self.prepared = prepared
        options = prepared.options
        self.response_id = options.response_id
        self.logprobs = options.logprobs is not None
        self.calls = ToolCallStream(options.response_id) if options.tools else None
        self.items: list[r.OutputItem] = []
        self.events: list[r.ResponseEvent] = []
        self.sequence = 0
        self.messages = 0  # message items opened
        self.message: r.OutputMessage | None = None  # the open one
        self.text: list[str] = []
        self.message_logprobs: list[r.Logprob] = []
        self.call: r.FunctionCall | None = None  # the open one
        self.arguments: list[str] = []

    def next(self) -> int:
        self.sequence += 1
        return self.sequence - 1

    def take(self, wire: Callable[[r.ResponseEvent], bytes] | None = None) -> list[bytes]:
        """The events made since the last take, as `wire` sends them (SSE frames by default)."""
        wire = wire or frame
        frames = [wire(ev) for ev in self.events]
        self.events.clear()
        return frames

    def feed(self, chunk: TextChunk) -> None:
        logprobs = [_logprob(t) for t in chunk.logprobs] if self.logprobs else []
        if self.calls is None:
            self._text(chunk.text, logprobs)
            return
        for piece in self.calls.feed(chunk.text):
            self._piece(piece, logprobs)
            if isinstance(piece, TextPiece):
                logprobs = []

    def _piece(self, piece: TextPiece | CallStart | ArgumentsPiece, logprobs: list) -> None:
        if isinstance(piece, TextPiece):
            self._text(piece.text, logprobs)
        elif isinstance(piece, CallStart):
            self._close_message("completed")
            self._close_call("completed")
            self.call = r.FunctionCall(
                id=f"fc_{self.response_id.removeprefix('resp_')}_{piece.index}",
                call_id=piece.id,
                name=piece.name,
                arguments="",
                status="in_progress",
            )
            self._emit(r.OutputItemAdded, output_index=len(self.items), item=self.call)
        elif self.call is not None:
            self.arguments.append(piece.text)
            self._emit(
                r.ArgumentsDelta,
                item_id=self.call.id,
                output_index=len(self.items),
                delta=piece.text,
            )

    def _text(self, text: str, logprobs: list[r.Logprob]) -> None:
        if not text and not logprobs:
            return
        if self.message is None:
            self._close_call("completed")
            self._open_message()
        assert self.message is not None
        self.text.append(text)
        self.message_logprobs.extend(logprobs)
        self._emit(
            r.OutputTextDelta,
            item_id=self.message.id,
            output_index=len(self.items),
            content_index=0,
            delta=text,
            logprobs=logprobs,
        )

    def _open_message(self) -> None:
        item_id = self.prepared.options.item_id
        self.message = r.OutputMessage(
            id=item_id if not self.messages else f"{item_id}_{self.messages}",
            status="in_progress",
            content=[],
        )
        self.messages += 1
        self.text, self.message_logprobs = [], []
        self._emit(r.OutputItemAdded, output_index=len(self.items), item=self.message)
        self._emit(
            r.ContentPartAdded,
            item_id=self.message.id,
            output_index=len(self.items),
            content_index=0,
            part=r.OutputText(text="", annotations=[]),
        )

    def _close_message(self, status: str) -> None:
        message, self.message = self.message, None
        if message is None:
            return
        text, at = "".join(self.text), len(self.items)
        logprobs = self.message_logprobs
        part = r.OutputText(text=text, annotations=[], logprobs=logprobs if self.logprobs else None)
        self._emit(
            r.OutputTextDone,
            item_id=message.id,
            output_index=at,
            content_index=0,
            text=text,
            logprobs=logprobs,
        )
        self._emit(
            r.ContentPartDone, item_id=message.id, output_index=at, content_index=0, part=part
        )
        done = r.OutputMessage(id=message.id, status=status, content=[part])  # type: ignore[arg-type]
        self._emit(r.OutputItemDone, output_index=at, item=done)
        self.items.append(done)

    def _close_call(self, status: str) -> None:
        call, self.call = self.call, None
        if call is None:
            return
        arguments, at = "".join(self.arguments), len(self.items)
        self.arguments = []
        self._emit(
            r.ArgumentsDone, item_id=call.id, output_index=at, arguments=arguments, name=call.name
        )
        done = r.FunctionCall(
            id=call.id,
            call_id=call.call_id,
            name=call.name,
            arguments=arguments,
            status=status,  # type: ignore[arg-type]
        )
        self._emit(r.OutputItemDone, output_index=at, item=done)
        self.items.append(done)

    def finish(self, finished: Finished | None) -> r.ResponseObject:
        """Close what is open and return the whole response."""
        if self.calls is not None:
            for piece in self.calls.finish():
                self._piece(piece, [])
        status = "failed" if finished is None else finished.status
        if finished is not None and finished.logprobs and self.logprobs:
            extra = [_logprob(t) for t in finished.logprobs]
            if self.message is None and not self.items and self.call is None:
                self._open_message()
            if self.message is not None:
                self.message_logprobs.extend(extra)
        if not self.items and self.message is None and self.call is None and status != "failed":
            self._open_message()  # an empty answer is still one (empty) message
        item_status = "completed" if status == "completed" else "incomplete"
        self._close_message(item_status)
        self._close_call(item_status)
        response = self.snapshot()
        response.output = list(self.items)
        if finished is None:  # the service ended without a result
            response.status = "failed"
            response.error = _error(GatewayError("engine_error", "the response ended early"))
            return response
        response.status = {"completed": "completed", "failed": "failed"}.get(
            finished.status, "cancelled" if finished.status == "cancelled" else "incomplete"
        )
        if response.status == "incomplete":
            reason = "max_output_tokens" if finished.reason == "max_output_tokens" else None
            response.incomplete_details = r.IncompleteDetails(reason=reason)
        if finished.status == "failed":
            response.error = _error(
                finished.error or GatewayError("engine_error", "the response failed")
            )
        response.usage = r.ResponseUsage(
            input_tokens=finished.input_tokens,
            input_tokens_details=r.InputTokensDetails(cached_tokens=finished.cached_tokens),
            output_tokens=finished.output_tokens,
            output_tokens_details=r.OutputTokensDetails(),
            total_tokens=finished.input_tokens + finished.output_tokens,
        )
        prepared = self.prepared
        response.visiongate = r.ResponseExtension(
            timings=p.Timings.of(finished),
            cache=p.CacheReport.of(finished),
            image_tokens=finished.image_tokens,
            image_tokens_total=finished.image_tokens_total,
            session_id=prepared.session.id if prepared.stored else None,
            truncated_items=finished.truncated_items,
            stored=(finished.status != "failed") if prepared.stored else None,
            forked=prepared.forked,
            notes=prepared.notes,
        )
        return response

    def snapshot(self) -> r.ResponseObject:
        """The response as it starts: in progress, no output yet; the request's values."""
        prepared, request, options = self.prepared, self.prepared.request, self.prepared.options
        session = prepared.session
        text: dict[str, Any] = {"format": {"type": "text"}}
        if request.text is not None:
            text = {k: v for k, v in msgspec.structs.asdict(request.text).items() if v}
            text.setdefault("format", {"type": "text"})
        response = r.ResponseObject(
            id=options.response_id,
            created_at=prepared.created_at,
            status="in_progress",
            model=prepared.model,
            output=[],
            usage=None,
            error=None,
            incomplete_details=None,
            instructions=request.instructions,
            previous_response_id=request.previous_response_id,
            store=prepared.stored,
            metadata=request.metadata or {},
            tools=request.tools or [],
            tool_choice=request.tool_choice or "auto",
            parallel_tool_calls=request.parallel_tool_calls is not False,
            temperature=session.temperature if options.temperature is None else options.temperature,
            top_p=session.top_p if options.top_p is None else options.top_p,
            max_output_tokens=request.max_output_tokens,
            text=text,
            truncation=request.truncation or "disabled",
            top_logprobs=request.top_logprobs,
            user=request.user,
            reasoning=request.reasoning,
        )
        return response

    def _emit(self, kind: type[r.ResponseEvent], **fields: Any) -> None:
        self.events.append(kind(sequence_number=self.next(), **fields))


def frame(event: r.ResponseEvent) -> bytes:
    return b"event: " + r.event_type(event).encode() + b"\ndata: " + _json.encode(event) + b"\n\n"


def _logprob(token: TokenLogprob) -> r.Logprob:
    return r.Logprob(
        token=token.token,
        bytes=list(token.bytes),
        logprob=token.logprob,
        top_logprobs=[r.TopLogprob(token=t, bytes=list(b), logprob=lp) for t, lp, b in token.top],
    )


def mark_failed(response: r.ResponseObject, exc: GatewayError) -> r.ResponseObject:
    """`response` as failed with `exc` (its output kept: the client has seen it stream)."""
    response.status = "failed"
    response.error = _error(exc)
    response.incomplete_details = None
    if response.visiongate is not None and response.visiongate.stored is not None:
        response.visiongate.stored = False
    return response


def _error(exc: GatewayError) -> r.ResponseError:
    code = _FAILED_CODES.get(exc.code, "server_error")
    if exc.code == "busy" and exc.retry_after_s is None:  # not the engine's queue: a store down
        code = "server_error"
    return r.ResponseError(
        code=code,
        message=exc.message,
        param=exc.param,
        type=exc.code,
    )
