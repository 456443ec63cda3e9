"""A chat completion's answers as the API shows them: choices, streamed deltas, SSE chunks.

`StreamedAnswer` reads one answer's text as it streams (with tools, through a `ToolCallStream`:
text goes out as content, each call as `tool_calls` deltas whose first carries id, type and
name and the next ones pieces of the arguments); `Frames` makes the stream's chunks;
`choice_of` builds a whole answer's choice the same way, so both agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from gateway.api.openai.chat import protocol as p
from gateway.chat.tool_stream import (
    ArgumentsPiece,
    CallStart,
    Piece,
    TextPiece,
    ToolCallStream,
    split_answer,
)

if TYPE_CHECKING:
    from gateway.chat.events import ChoiceEnd, Finished, ResponseOptions
    from gateway.engine.interface import TokenLogprob

__all__ = ("Frames", "StreamedAnswer", "answer_id", "choice_of", "finish_reason_of", "usage_of")

_json = msgspec.json.Encoder()


def answer_id(response_id: str, index: int) -> str:
    """What names the tool calls of answer `index` (the first answer's are the stored ones)."""
    return response_id if index == 0 else f"{response_id}/{index}"


def finish_reason_of(end: ChoiceEnd, called: bool) -> p.FinishReason:
    if end.status == "incomplete":
        return "length"
    return "tool_calls" if called else "stop"


def choice_of(end: ChoiceEnd, logprobs: list[TokenLogprob], options: ResponseOptions) -> p.Choice:
    text, calls = end.text, []
    if options.tools:
        text, calls = split_answer(end.text, answer_id(options.response_id, end.index))
    message = p.ChatMessage(
        content=text if text or not calls else None,
        refusal=None,
        role="assistant",
        tool_calls=[
            p.ToolCall(id=c.id, function=p.ToolCallFunction(name=c.name, arguments=c.arguments))
            for c in calls
        ]
        or msgspec.UNSET,
    )
    return p.Choice(
        index=end.index,
        message=message,
        finish_reason=finish_reason_of(end, bool(calls)),
        logprobs=p.ChoiceLogprobs.of(logprobs) if options.logprobs is not None else None,
    )


class StreamedAnswer:
    """One answer of a stream: its text read into content and tool-call deltas, and the
    log-probabilities not sent yet (they go with the next frame of this answer)."""

    __slots__ = ("calls", "logprobs", "plain", "reader", "wants_logprobs")

    def __init__(self, options: ResponseOptions, index: int) -> None:
        self.reader = (
            ToolCallStream(answer_id(options.response_id, index)) if options.tools else None
        )
        self.calls = 0
        self.logprobs: list[TokenLogprob] = []
        self.wants_logprobs = options.logprobs is not None
        # no tools to read and no log-probabilities: each piece of text is a frame as it came
        self.plain = self.reader is None and not self.wants_logprobs

    def feed(self, text: str) -> list[p.Delta]:
        if self.reader is None:
            return [p.Delta(content=text)] if text else []
        return self._deltas(self.reader.feed(text))

    def finish(self) -> list[p.Delta]:
        return [] if self.reader is None else self._deltas(self.reader.finish())

    def take_logprobs(self) -> p.ChoiceLogprobs | None:
        if not self.wants_logprobs:
            return None
        taken = p.ChoiceLogprobs.of(self.logprobs)
        self.logprobs = []
        return taken

    def _deltas(self, pieces: list[Piece]) -> list[p.Delta]:
        deltas: list[p.Delta] = []
        for piece in pieces:
            if isinstance(piece, TextPiece):
                deltas.append(p.Delta(content=piece.text))
            elif isinstance(piece, CallStart):
                self.calls += 1
                function = p.DeltaFunction(name=piece.name, arguments="")
                call = p.DeltaToolCall(piece.index, id=piece.id, type="function", function=function)
                deltas.append(p.Delta(tool_calls=[call]))
            elif isinstance(piece, ArgumentsPiece):
                function = p.DeltaFunction(arguments=piece.text)
                deltas.append(p.Delta(tool_calls=[p.DeltaToolCall(piece.index, function=function)]))
        return deltas


# stands for a delta's text in a frame encoded once, then cut there (`Frames._text_frame`)
_TEXT_MARK = "\x00\x01text\x01\x00"
_TEXT_MARK_JSON = _json.encode(_TEXT_MARK)


class Frames:
    """SSE frames of one completion's chunks.

    Most frames of a stream are a choice's next piece of text and nothing else: those are the
    bytes of one such frame encoded once per choice (`_text_frame`), around the text's own JSON
    string, identical to what encoding the whole chunk would give."""

    __slots__ = (
        "_text_frames",
        "completion_id",
        "created",
        "fingerprint",
        "include_usage",
        "model",
    )

    def __init__(
        self, completion_id: str, created: int, model: str, fingerprint: str, include_usage: bool
    ) -> None:
        self.completion_id, self.created, self.model = completion_id, created, model
        self.fingerprint = fingerprint
        self.include_usage = include_usage
        self._text_frames: dict[int, tuple[bytes, bytes] | None] = {}

    def __call__(
        self,
        index: int,
        delta: p.Delta,
        *,
        finish_reason: p.FinishReason | None = None,
        logprobs: p.ChoiceLogprobs | None = None,
        extension: p.CompletionExtension | None = None,
    ) -> bytes:
        if (
            finish_reason is None
            and logprobs is None
            and extension is None
            and delta.role is msgspec.UNSET
            and delta.tool_calls is msgspec.UNSET
            and type(delta.content) is str
        ):
            return self.text(index, delta.content)
        choice = p.ChunkChoice(index, delta, finish_reason=finish_reason, logprobs=logprobs)
        return self._encode([choice], None, extension)

    def text(self, index: int, text: str) -> bytes:
        """The frame of choice `index`'s next piece of text, and nothing else."""
        around = self._text_frames.get(index, False)
        if around is False:
            around = self._text_frames[index] = self._text_frame(index)
        if around is None:
            choice = p.ChunkChoice(index, p.Delta(content=text))
            return self._encode([choice], None, None)
        return around[0] + _json.encode(text) + around[1]

    def _text_frame(self, index: int) -> tuple[bytes, bytes] | None:
        """The bytes before and after the text in a text-only frame of choice `index`; None
        where the mark's JSON is found more than once (a model name holding it)."""
        choice = p.ChunkChoice(index, p.Delta(content=_TEXT_MARK))
        before, *after = self._encode([choice], None, None).split(_TEXT_MARK_JSON)
        return (before, after[0]) if len(after) == 1 else None

    def usage(self, usage: p.Usage) -> bytes:
        return self._encode([], usage, None)

    def _encode(
        self,
        choices: list[p.ChunkChoice],
        usage: p.Usage | None,
        extension: p.CompletionExtension | None,
    ) -> bytes:
        chunk = p.ChatCompletionChunk(
            id=self.completion_id,
            object="chat.completion.chunk",
            created=self.created,
            model=self.model,
            system_fingerprint=self.fingerprint,
            choices=choices,
            # asked for: null on every chunk but the last; not asked for: left out
            usage=usage if self.include_usage else msgspec.UNSET,
            visiongate=extension,
        )
        return b"data: " + _json.encode(chunk) + b"\n\n"


def usage_of(ev: Finished, ext: p.CompletionExtension) -> p.Usage:
    return p.Usage(
        prompt_tokens=ev.input_tokens,
        completion_tokens=ev.output_tokens,
        total_tokens=ev.input_tokens + ev.output_tokens,
        prompt_tokens_details=p.PromptTokensDetails(
            cached_tokens=ev.cached_tokens, image_tokens=ev.image_tokens
        ),
        visiongate=ext,
    )
