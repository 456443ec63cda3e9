"""Tool calls in the model's text: how one is written, and how an answer is read back.

A call is written exactly as `render_tool_call` writes it (one line of JSON between tags, keys in
a fixed order, fixed whitespace), several calls joined by a newline:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The grammars of `gateway.chat.output_grammar` make the model write exactly this, byte for byte, so
the
reader here can be a small state machine: it looks for the fixed head `<tool_call>\\n{"name": "`,
reads a name of `[A-Za-z0-9_-]`, the fixed `", "arguments": `, one JSON object (it only counts
braces outside strings; the grammar already made it valid), then the fixed tail. The same reader
serves streaming (`ToolCallStream`) and whole answers (`split_answer`), so both give the same
calls. Text that only looks like the start of a call is emitted as text once it stops matching.

Blank text between calls, or between a call and either end of the answer, is layout and not
text; any other text is kept verbatim. `render_answer(text, calls)` writes an answer back the way
the model wrote it, so a history the client sends back renders to the same tokens.

Not here: which calls are allowed (the grammar's job) and checking names against the tools.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = (
    "ArgumentsPiece",
    "CallStart",
    "Piece",
    "TextPiece",
    "ToolCall",
    "ToolCallStream",
    "call_id",
    "render_answer",
    "render_tool_call",
    "render_tool_result",
    "split_answer",
)

CALL_HEAD = '<tool_call>\n{"name": "'
CALL_SEP = '", "arguments": '
CALL_TAIL = "}\n</tool_call>"
CALL_JOIN = "\n"  # between two calls of one answer
MAX_NAME = 64
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass(frozen=True, slots=True)
class TextPiece:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsPiece:
    index: int
    text: str


Piece = TextPiece | CallStart | ArgumentsPiece


def render_tool_call(name: str, arguments: str) -> str:
    """A call as the model writes it under the tools grammar (byte-identical)."""
    return f"{CALL_HEAD}{name}{CALL_SEP}{arguments}{CALL_TAIL}"


def render_tool_result(content: str) -> str:
    """A tool's result as the model is shown it, in the tags the tools prompt announces."""
    return f"<tool_response>\n{content}\n</tool_response>"


def render_answer(text: str, calls: Sequence[ToolCall]) -> str:
    """An assistant answer of text and calls as the model wrote it: the inverse of
    `split_answer` for the answers the grammars allow."""
    return text + CALL_JOIN.join(render_tool_call(c.name, c.arguments) for c in calls)


def call_id(response_id: str, index: int) -> str:
    """The id of a response's `index`th call: the same on every replica and every replay."""
    digest = hashlib.sha256(f"{response_id}/{index}".encode()).hexdigest()
    return f"call_{digest[:24]}"


def split_answer(text: str, response_id: str) -> tuple[str, list[ToolCall]]:
    """A finished answer -> (its text outside calls, its calls in order)."""
    stream = ToolCallStream(response_id)
    pieces = stream.feed(text) + stream.finish()
    parts: list[str] = []
    starts: list[CallStart] = []
    arguments: dict[int, list[str]] = {}
    for piece in pieces:
        if isinstance(piece, TextPiece):
            parts.append(piece.text)
        elif isinstance(piece, CallStart):
            starts.append(piece)
            arguments[piece.index] = []
        else:
            arguments[piece.index].append(piece.text)
    calls = [ToolCall(s.id, s.name, "".join(arguments[s.index])) for s in starts]
    return "".join(parts), calls


def _partial_head(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of CALL_HEAD."""
    start = max(0, len(text) - len(CALL_HEAD) + 1)
    while True:
        at = text.find("<", start)
        if at < 0:
            return 0
        if CALL_HEAD.startswith(text[at:]):
            return len(text) - at
        start = at + 1


class _Pieces:
    """Pieces of one feed, adjacent text (or one call's arguments) merged."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[Piece] = []

    def text(self, text: str) -> None:
        if not text:
            return
        last = self.items[-1] if self.items else None
        if isinstance(last, TextPiece):
            self.items[-1] = TextPiece(last.text + text)
        else:
            self.items.append(TextPiece(text))

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        last = self.items[-1] if self.items else None
        if isinstance(last, ArgumentsPiece) and last.index == index:
            self.items[-1] = ArgumentsPiece(index, last.text + text)
        else:
            self.items.append(ArgumentsPiece(index, text))


# reader states
_TEXT, _NAME, _SEP, _ARGS, _TAIL, _DONE = range(6)


class ToolCallStream:
    """Reads an answer as it streams: text that cannot be part of a call goes out at once (only a
    tail that could begin a call, or blank text next to a call, is held back), a `CallStart` as
    soon as a call's name is read, then its arguments in pieces as they arrive."""

    __slots__ = (
        "_blank",
        "_depth",
        "_escape",
        "_held",
        "_in_string",
        "_index",
        "_lead",
        "_matched",
        "_name",
        "_response_id",
        "_state",
    )

    def __init__(self, response_id: str) -> None:
        self._response_id = response_id
        self._state = _TEXT
        self._held = ""  # text not yet emitted (a possible call head, or blank text)
        self._blank = True  # the current text run is blank so far and next to a call or an end
        self._lead = ""  # blank text dropped before a head that may yet turn out to be text
        self._name = ""
        self._matched = 0  # characters of CALL_SEP / CALL_TAIL matched
        self._depth = 0  # of the arguments object's braces and brackets
        self._in_string = False
        self._escape = False
        self._index = 0  # calls started so far

    def feed(self, text: str) -> list[Piece]:
        if self._state == _DONE:
            raise RuntimeError("feed after finish")
        out = _Pieces()
        while text:
            if self._state == _TEXT:
                text = self._read_text(text, out)
            elif self._state == _NAME:
                text = self._read_name(text, out)
            elif self._state == _ARGS:
                text = self._read_arguments(text, out)
            else:
                text = self._read_fixed(text)
        return out.items

    def finish(self) -> list[Piece]:
        """The pieces still held back; an unfinished call keeps what was read of it."""
        out = _Pieces()
        # after a call, blank text and the start of a head cut short are what was left of the
        # next call; before any call they are text (the answer may well be text alone)
        after_call = self._blank and self._index > 0
        if self._state == _TEXT:
            if not (after_call and CALL_HEAD.startswith(self._held.lstrip())):
                out.text(self._held)
        elif self._state == _NAME and not after_call:  # no name yet, so no call: it was text
            out.text(self._lead + CALL_HEAD + self._name)
        self._held = ""
        self._state = _DONE
        return out.items

    def _read_text(self, text: str, out: _Pieces) -> str:
        buf = self._held + text
        at = buf.find(CALL_HEAD)
        if at >= 0:
            before = buf[:at]
            if self._blank and not before.strip():
                self._lead = before
            else:
                out.text(before)
                self._blank, self._lead = False, ""
            self._held = ""
            self._name = ""
            self._state = _NAME
            return buf[at + len(CALL_HEAD) :]
        cut = len(buf) - _partial_head(buf)
        if self._blank and not buf[:cut].strip():
            self._held = buf  # still blank: layout if a call follows
            return ""
        self._blank = False
        out.text(buf[:cut])
        self._held = buf[cut:]
        return ""

    def _read_name(self, text: str, out: _Pieces) -> str:
        for i, char in enumerate(text):
            if char in NAME_CHARS and len(self._name) < MAX_NAME:
                self._name += char
                continue
            if char == '"' and self._name:
                out.items.append(
                    CallStart(self._index, call_id(self._response_id, self._index), self._name)
                )
                self._state, self._matched = _SEP, 1
                return text[i + 1 :]
            # not a call after all: the head and the name so far were text
            out.text(self._lead + CALL_HEAD + self._name)
            self._blank, self._lead = False, ""
            self._state = _TEXT
            return text[i:]
        return ""

    def _read_fixed(self, text: str) -> str:
        """CALL_SEP after the name, or CALL_TAIL after the arguments; a mismatch ends the call
        there and reading goes on as text from the character that did not match."""
        fixed = CALL_SEP if self._state == _SEP else CALL_TAIL
        for i, char in enumerate(text):
            if char != fixed[self._matched]:
                self._end_call()
                return text[i:]
            self._matched += 1
            if self._matched == len(fixed):
                if self._state == _SEP:
                    self._state, self._depth = _ARGS, 0
                    self._in_string = self._escape = False
                else:
                    self._end_call()
                return text[i + 1 :]
        return ""

    def _read_arguments(self, text: str, out: _Pieces) -> str:
        if self._depth == 0 and text[0] != "{":  # arguments are an object or nothing
            self._end_call()
            return text
        for i, char in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    out.arguments(self._index, text[: i + 1])
                    self._state, self._matched = _TAIL, 0
                    return text[i + 1 :]
        out.arguments(self._index, text)
        return ""

    def _end_call(self) -> None:
        self._index += 1
        self._state = _TEXT
        self._blank = True
        self._lead = ""
