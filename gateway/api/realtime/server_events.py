"""Realtime server events: what the gateway sends, as the OpenAI Realtime API names them, plus
the `visiongate.image.encoded` extension and `visiongate` fields on sessions and responses.

Server events are Structs encoded with `omit_defaults`, so absent optional fields are left
out; they are only ever encoded (`protocol.WireCodec.encode`), never decoded by the gateway.
Items are the client's own shapes (`gateway.api.realtime.client_events`).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct

from gateway.api.realtime.client_events import Item
from gateway.protocol.report import CacheReport, Timings

__all__ = (
    "CachedTokensDetails",
    "ContentPartAdded",
    "ContentPartDone",
    "ConversationItemAdded",
    "ConversationItemDeleted",
    "ConversationItemDone",
    "ConversationItemRetrieved",
    "ConversationItemTruncated",
    "ErrorBody",
    "ErrorEvent",
    "FunctionCallArgumentsDelta",
    "FunctionCallArgumentsDone",
    "ImageEncoded",
    "InputTokenDetails",
    "OutputItemAdded",
    "OutputItemDone",
    "OutputTextDelta",
    "OutputTextDone",
    "OutputTokenDetails",
    "Part",
    "RateLimit",
    "RateLimitsUpdated",
    "ResponseCreated",
    "ResponseDone",
    "ResponseExtension",
    "ResponseState",
    "ServerEvent",
    "SessionCreated",
    "SessionState",
    "SessionUpdated",
    "StatusDetails",
    "StatusError",
    "Usage",
)


# ---------------------------------------------------------------- server events


class ErrorBody(Struct):
    type: str
    code: str
    message: str
    param: str | None = None
    event_id: str | None = None


class ErrorEvent(Struct, tag="error", tag_field="type"):
    event_id: str
    error: ErrorBody


class SessionState(Struct, omit_defaults=True):
    id: str
    model: str
    instructions: str
    max_output_tokens: int | Literal["inf"]
    type: Literal["realtime"] = "realtime"
    object: Literal["realtime.session"] = "realtime.session"
    output_modalities: list[str] = msgspec.field(default_factory=lambda: ["text"])
    expires_at: int | None = None
    tools: list[Any] | None = None  # as the client sent them
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    visiongate: dict[str, Any] | None = None  # temperature, top_p, seed, items, resumed


class SessionCreated(Struct, tag="session.created", tag_field="type"):
    event_id: str
    session: SessionState


class SessionUpdated(Struct, tag="session.updated", tag_field="type"):
    event_id: str
    session: SessionState


class ConversationItemAdded(Struct, tag="conversation.item.added", tag_field="type"):
    event_id: str
    item: Item
    previous_item_id: str | None = None


class ConversationItemDone(Struct, tag="conversation.item.done", tag_field="type"):
    event_id: str
    item: Item
    previous_item_id: str | None = None


class ConversationItemRetrieved(Struct, tag="conversation.item.retrieved", tag_field="type"):
    event_id: str
    item: Item


class ConversationItemDeleted(Struct, tag="conversation.item.deleted", tag_field="type"):
    event_id: str
    item_id: str


class ConversationItemTruncated(Struct, tag="conversation.item.truncated", tag_field="type"):
    event_id: str
    item_id: str
    content_index: int
    audio_end_ms: int


class ImageEncoded(Struct, tag="visiongate.image.encoded", tag_field="type"):
    """visiongate extension: an image of an item finished encoding (or came from the cache)."""

    event_id: str
    item_id: str
    content_index: int
    digest: str
    tokens_kept: int
    tokens_total: int
    encode_ms: float
    cache: Literal["hit", "miss"]


class CachedTokensDetails(Struct):
    text_tokens: int = 0
    image_tokens: int = 0
    audio_tokens: int = 0


class InputTokenDetails(Struct):
    text_tokens: int = 0
    image_tokens: int = 0
    audio_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_details: CachedTokensDetails = msgspec.field(default_factory=CachedTokensDetails)


class OutputTokenDetails(Struct):
    text_tokens: int = 0
    audio_tokens: int = 0


class Usage(Struct):
    total_tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    input_token_details: InputTokenDetails = msgspec.field(default_factory=InputTokenDetails)
    output_token_details: OutputTokenDetails = msgspec.field(default_factory=OutputTokenDetails)


class StatusError(Struct, omit_defaults=True):
    type: str | None = None
    code: str | None = None
    message: str | None = None


class StatusDetails(Struct, omit_defaults=True):
    type: Literal["completed", "cancelled", "incomplete", "failed"] | None = None
    reason: (
        Literal["client_cancelled", "max_output_tokens", "turn_detected", "content_filter"] | None
    ) = None
    error: StatusError | None = None


class ResponseExtension(Struct):
    timings: Timings
    cache: CacheReport
    image_tokens_total: int = 0  # visual tokens before patch dropping
    model: str = ""
    truncated_items: int = 0  # oldest items left out to fit the context (truncation "auto")


class ResponseState(Struct, omit_defaults=True):
    id: str
    status: Literal["in_progress", "completed", "cancelled", "incomplete", "failed"]
    conversation_id: str | None  # null for an out-of-band response (always sent)
    object: Literal["realtime.response"] = "realtime.response"
    output: list[Item] = msgspec.field(default_factory=list)
    output_modalities: list[str] = msgspec.field(default_factory=lambda: ["text"])
    max_output_tokens: int | Literal["inf"] | None = None
    metadata: dict[str, str] | None = None
    status_details: StatusDetails | None = None
    usage: Usage | None = None
    visiongate: ResponseExtension | None = None


class ResponseCreated(Struct, tag="response.created", tag_field="type"):
    event_id: str
    response: ResponseState


class ResponseDone(Struct, tag="response.done", tag_field="type"):
    event_id: str
    response: ResponseState


class OutputItemAdded(Struct, tag="response.output_item.added", tag_field="type"):
    event_id: str
    response_id: str
    output_index: int
    item: Item


class OutputItemDone(Struct, tag="response.output_item.done", tag_field="type"):
    event_id: str
    response_id: str
    output_index: int
    item: Item


class Part(Struct):
    type: Literal["text"] = "text"
    text: str = ""


class ContentPartAdded(Struct, tag="response.content_part.added", tag_field="type"):
    event_id: str
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    part: Part


class ContentPartDone(Struct, tag="response.content_part.done", tag_field="type"):
    event_id: str
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    part: Part


class OutputTextDelta(Struct, tag="response.output_text.delta", tag_field="type"):
    event_id: str
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    delta: str


class OutputTextDone(Struct, tag="response.output_text.done", tag_field="type"):
    event_id: str
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(
    Struct, tag="response.function_call_arguments.delta", tag_field="type"
):
    event_id: str
    response_id: str
    item_id: str
    output_index: int
    call_id: str
    delta: str


class FunctionCallArgumentsDone(
    Struct, tag="response.function_call_arguments.done", tag_field="type"
):
    event_id: str
    response_id: str
    item_id: str
    output_index: int
    call_id: str
    name: str
    arguments: str


class RateLimit(Struct):
    """One of the API key's limits after a response: "requests" (per minute) or "tokens"
    (its tightest token limit), with what is left and the seconds until it is whole."""

    name: Literal["requests", "tokens"]
    limit: int
    remaining: int
    reset_seconds: float


class RateLimitsUpdated(Struct, tag="rate_limits.updated", tag_field="type"):
    """Sent after each `response.done` when the connection's key has limits."""

    event_id: str
    rate_limits: list[RateLimit]


ServerEvent = (
    ErrorEvent
    | SessionCreated
    | SessionUpdated
    | ConversationItemAdded
    | ConversationItemDone
    | ConversationItemRetrieved
    | ConversationItemDeleted
    | ConversationItemTruncated
    | ImageEncoded
    | ResponseCreated
    | ResponseDone
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | RateLimitsUpdated
)
