"""What one response is asked to do and what it yields, independent of the transport.

`ChatService.respond` takes `ResponseOptions` and yields `Started`, `TextChunk`s, then one
`Finished` carrying usage, timings and cache results. The WebSocket and HTTP layers, the
per-response report and the trace all read these types; this module imports nothing of the
gateway but the error type and id helper, so any layer can use it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from gateway.protocol.errors import GatewayError
from gateway.sessions.session import new_id

if TYPE_CHECKING:
    from gateway.engine.interface import TokenLogprob

__all__ = (
    "ChoiceEnd",
    "Finished",
    "ResponseOptions",
    "ServiceEvent",
    "Started",
    "Status",
    "TextChunk",
)

Status = Literal["completed", "cancelled", "incomplete", "failed"]


@dataclass(frozen=True, slots=True)
class ResponseOptions:
    """What one response is asked to do: built once by the transport that takes the request,
    read-only after (a changed value is a new one: `dataclasses.replace`). `cancel` is the one
    thing that changes: it is set to stop the answer."""

    instructions: str | None = None  # overrides the session's for this response
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    truncation: Literal["auto", "disabled"] | None = None  # None: the session's
    store: bool = True  # append the answer to the conversation
    response_id: str = field(default_factory=lambda: new_id("resp"))
    # the id the client is given for the response when it is not `response_id` (Chat
    # Completions' chatcmpl-...): what the trace and the access log name the response by
    client_id: str | None = None
    item_id: str = field(default_factory=lambda: new_id("item"))
    api: str = "realtime"
    session_load_ns: tuple[int, int] | None = None  # when the caller loaded the session (epoch ns)
    cancel: threading.Event = field(default_factory=threading.Event)  # set to stop the answer
    logprobs: int | None = None  # None: none; k: each token's logprob and k alternatives
    n: int = 1  # answers sampled from the one prompt; only the first is stored in the session
    grammar: str | None = None  # constrained decoding (see `gateway.chat.output_grammar`)
    # appended to the instructions for this response: the tools the model may call and how
    tools_prompt: str | None = None
    # the answer may hold tool calls: it is stored as text and tool-call parts
    tools: bool = False
    # narrows the API key's prefix-cache namespace (HTTP `cache_salt`); None: the key's own
    cache_salt: str | None = None


@dataclass(slots=True)
class Started:
    response_id: str
    item_id: str


@dataclass(slots=True)
class TextChunk:
    text: str
    index: int = 0  # which answer (ResponseOptions.n)
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens in `text`, when asked for


@dataclass(slots=True)
class ChoiceEnd:
    """How one of several answers (ResponseOptions.n > 1) ended."""

    index: int
    text: str
    status: Status
    reason: str | None = None
    output_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()  # tokens not sent with a TextChunk


@dataclass(slots=True)
class Finished:
    response_id: str
    item_id: str
    status: Status
    text: str
    reason: str | None = None  # client_cancelled | max_output_tokens
    error: GatewayError | None = None
    input_tokens: int = 0
    image_tokens: int = 0
    image_tokens_total: int = 0
    text_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cached_image_tokens: int = 0
    kv_warmed_tokens: int = 0  # of cached_tokens, prefilled by a KV warm-up before the request
    # the keep-ratio cap new images were encoded under (adaptive visual budget); None: fixed
    visual_budget: float | None = None
    vision_hits: int = 0
    vision_misses: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    truncated_items: int = 0  # oldest conversation items left out to fit the context
    # with n > 1: every answer in index order (the first is also `text`/`status` above, and
    # `output_tokens` counts them all); empty with n == 1
    choices: list[ChoiceEnd] = field(default_factory=list)
    logprobs: tuple[TokenLogprob, ...] = ()  # the first answer's tokens not sent with a chunk

    def answers(self) -> list[ChoiceEnd]:
        """How every answer ended, in index order: `choices`, or the one answer's own end."""
        if self.choices:
            return self.choices
        end = ChoiceEnd(0, self.text, self.status, self.reason, self.output_tokens, self.logprobs)
        return [end]

    @property
    def vision(self) -> str:
        if self.vision_hits == 0 and self.vision_misses == 0:
            return "none"
        if self.vision_misses == 0:
            return "hit"
        return "miss" if self.vision_hits == 0 else "partial"


ServiceEvent = Started | TextChunk | Finished
