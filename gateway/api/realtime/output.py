"""One Realtime response's output: the service's events as `response.*` server events.

Without tools the answer is one assistant message, opened as the response starts. With tools
the answer is read as it streams (`gateway.chat.tool_stream.ToolCallStream`, as Chat Completions and
the Responses API read theirs): text goes out in a message item, each call as a
`function_call` item (`response.output_item.added` as soon as its name is read, then
`response.function_call_arguments.delta` ..., `.done`, `response.output_item.done`). Output item
`n` has the id `realtime_items.output_item_id(item_id, n)`, the ids the stored items get.
`response.done` carries the items, `usage`, the client's `metadata` and the `visiongate`
extension.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from gateway.api.realtime import protocol as rt
from gateway.api.realtime.items import output_item_id
from gateway.api.realtime.text_frames import TextDeltaFrames
from gateway.chat.events import Finished, Started, TextChunk
from gateway.chat.tool_stream import ArgumentsPiece, CallStart, Piece, TextPiece, ToolCallStream
from gateway.protocol.report import CacheReport, Timings

if TYPE_CHECKING:
    from gateway.chat.events import ResponseOptions
    from gateway.protocol.errors import GatewayError

__all__ = ("RealtimeResponseWriter",)

Send = Callable[[rt.ServerEvent], Awaitable[None]]


class RealtimeResponseWriter:
    """Turns one response's service events into server events, in order."""

    __slots__ = (
        "_arguments",
        "_codec",
        "_eid",
        "_frames",
        "_open",
        "_send",
        "_text",
        "conversation",
        "items",
        "metadata",
        "model",
        "options",
        "reader",
    )

    def __init__(
        self,
        options: ResponseOptions,
        *,
        send: Send,
        eid: Callable[[], str],
        conversation: str | None,
        metadata: dict[str, str] | None,
        model: str,
        codec: rt.WireCodec | None = None,
    ) -> None:
        self.options = options
        self._send = send
        self._eid = eid
        self.conversation = conversation
        self.metadata = metadata
        self.model = model
        self.reader = ToolCallStream(options.response_id) if options.tools else None
        self.items: list[rt.Item] = []  # output items, each in its latest state
        self._open: rt.MessageItem | rt.FunctionCallItem | None = None
        self._text: list[str] = []
        self._arguments: list[str] = []
        self._codec = codec  # given: a plain answer's text frames come from a template
        self._frames: TextDeltaFrames | None = None  # the open message's, when they do

    @property
    def rid(self) -> str:
        return self.options.response_id

    async def on_event(self, ev: object) -> None:
        if isinstance(ev, Started):
            await self._send(rt.ResponseCreated(self._eid(), self._state("in_progress")))
            if self.reader is None:  # a plain answer: its message opens at once
                await self._open_message()
        elif isinstance(ev, TextChunk):
            if self.reader is None:
                await self._delta(ev.text)
            else:
                for piece in self.reader.feed(ev.text):
                    await self._piece(piece)

    def text_frame(self, text: str) -> bytes | None:
        """The frame of a plain answer's next piece of text (`text_frames`, UTF-8), the text
        kept as `on_event` keeps it; None where the event is built and encoded whole
        (`on_event`): an answer read for tool calls, a msgpack connection, no message open."""
        frames = self._frames
        if frames is None:
            return None
        self._text.append(text)
        return frames.frame(self._eid(), text)

    async def close_items(self, ev: Finished) -> None:
        """Send what is left of the answer and close its items (not for a failed response)."""
        if self.reader is not None:
            for piece in self.reader.finish():
                await self._piece(piece)
        if not self.items:  # an empty answer is still one (empty) message
            await self._open_message()
        await self._close(_item_status(ev))

    async def done(self, ev: Finished) -> None:
        details = None
        if ev.status == "cancelled":
            details = rt.StatusDetails(type="cancelled", reason="client_cancelled")
        elif ev.status == "incomplete":
            details = rt.StatusDetails(type="incomplete", reason=ev.reason or "max_output_tokens")
        elif ev.status == "failed" and ev.error is not None:
            details = rt.StatusDetails(type="failed", error=_status_error(ev.error))
        state = self._state(ev.status)
        state.output = self.items if ev.status != "failed" else []
        state.status_details = details
        state.usage = _usage(ev)
        state.visiongate = rt.ResponseExtension(
            timings=Timings.of(ev),
            cache=CacheReport.of(ev),
            image_tokens_total=ev.image_tokens_total,
            model=self.model,
            truncated_items=ev.truncated_items,
        )
        await self._send(rt.ResponseDone(self._eid(), state))

    # ------------------------------------------------------------ items

    def _state(self, status: str) -> rt.ResponseState:
        return rt.ResponseState(
            id=self.rid,
            status=status,  # type: ignore[arg-type]
            conversation_id=self.conversation,
            max_output_tokens=self.options.max_output_tokens,
            metadata=self.metadata,
        )

    def _next_id(self) -> str:
        return output_item_id(self.options.item_id, len(self.items))

    async def _piece(self, piece: Piece) -> None:
        if isinstance(piece, TextPiece):
            if not isinstance(self._open, rt.MessageItem):
                await self._close("completed")
                await self._open_message()
            await self._delta(piece.text)
        elif isinstance(piece, CallStart):
            await self._close("completed")
            call = rt.FunctionCallItem(
                name=piece.name,
                arguments="",
                call_id=piece.id,
                id=self._next_id(),
                object="realtime.item",
                status="in_progress",
            )
            self._open, self._arguments = call, []
            self.items.append(call)
            await self._send(rt.OutputItemAdded(self._eid(), self.rid, len(self.items) - 1, call))
        elif isinstance(piece, ArgumentsPiece) and isinstance(self._open, rt.FunctionCallItem):
            self._arguments.append(piece.text)
            await self._send(
                rt.FunctionCallArgumentsDelta(
                    self._eid(),
                    self.rid,
                    self._open.id or "",
                    len(self.items) - 1,
                    self._open.call_id or "",
                    piece.text,
                )
            )

    async def _open_message(self) -> None:
        item = rt.MessageItem(
            role="assistant",
            content=[],
            id=self._next_id(),
            object="realtime.item",
            status="in_progress",
        )
        self._open, self._text = item, []
        self.items.append(item)
        index = len(self.items) - 1
        if self._codec is not None and self.reader is None:
            self._frames = TextDeltaFrames.of(self._codec, self.rid, item.id or "", index)
        await self._send(rt.OutputItemAdded(self._eid(), self.rid, index, item))
        await self._send(
            rt.ContentPartAdded(self._eid(), self.rid, item.id or "", index, 0, rt.Part())
        )

    async def _delta(self, text: str) -> None:
        assert self._open is not None
        self._text.append(text)
        await self._send(
            rt.OutputTextDelta(
                self._eid(), self.rid, self._open.id or "", len(self.items) - 1, 0, text
            )
        )

    async def _close(self, status: str) -> None:
        """Close the open item: its done events, and its final state in `items`."""
        item, self._open = self._open, None
        self._frames = None
        if item is None:
            return
        index = len(self.items) - 1
        iid = item.id or ""
        if isinstance(item, rt.MessageItem):
            text = "".join(self._text)
            await self._send(rt.OutputTextDone(self._eid(), self.rid, iid, index, 0, text))
            await self._send(
                rt.ContentPartDone(self._eid(), self.rid, iid, index, 0, rt.Part(text=text))
            )
            final: rt.Item = rt.MessageItem(
                role="assistant",
                content=[rt.ContentPart("output_text", text=text)],
                id=iid,
                object="realtime.item",
                status=status,  # type: ignore[arg-type]
            )
        else:
            arguments = "".join(self._arguments)
            await self._send(
                rt.FunctionCallArgumentsDone(
                    self._eid(), self.rid, iid, index, item.call_id or "", item.name, arguments
                )
            )
            final = rt.FunctionCallItem(
                name=item.name,
                arguments=arguments,
                call_id=item.call_id,
                id=iid,
                object="realtime.item",
                status=status,  # type: ignore[arg-type]
            )
        self.items[index] = final
        await self._send(rt.OutputItemDone(self._eid(), self.rid, index, final))


def _usage(ev: Finished) -> rt.Usage:
    return rt.Usage(
        total_tokens=ev.input_tokens + ev.output_tokens,
        input_tokens=ev.input_tokens,
        output_tokens=ev.output_tokens,
        input_token_details=rt.InputTokenDetails(
            text_tokens=ev.text_tokens,
            image_tokens=ev.image_tokens,
            cached_tokens=ev.cached_tokens,
            cached_tokens_details=rt.CachedTokensDetails(
                image_tokens=ev.cached_image_tokens,
                text_tokens=ev.cached_tokens - ev.cached_image_tokens,
            ),
        ),
        output_token_details=rt.OutputTokenDetails(text_tokens=ev.output_tokens),
    )


def _item_status(ev: Finished) -> str:
    return "completed" if ev.status == "completed" else "incomplete"


def _status_error(error: GatewayError) -> rt.StatusError:
    return rt.StatusError(type=error.type, code=error.code, message=error.message)
