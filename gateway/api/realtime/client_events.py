"""Realtime client events and the conversation items they carry (the text-and-image subset
of the OpenAI Realtime API).

Items are a tagged union on `type` as in the GA API: `message` (text and image parts),
`function_call` and `function_call_output`; `response.input` also takes `item_reference`.
Server events carry the same item shapes back (`gateway.api.realtime.server_events`), so they
are defined here once. Client events are one tagged union on `type` (`ClientEvent`), decoded by
`protocol.WireCodec`. Unknown fields are ignored, so a client that sends the full Realtime
shapes works unchanged; what a client names or attaches (ids, metadata) is bounded here, so
nothing of any size is stored or echoed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Struct

__all__ = (
    "CLIENT_EVENT_TYPES",
    "MAX_ID_CHARS",
    "ClientEvent",
    "ClientId",
    "ContentPart",
    "ConversationItemCreate",
    "ConversationItemDelete",
    "ConversationItemRetrieve",
    "ConversationItemTruncate",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "InputItem",
    "Item",
    "ItemReference",
    "MessageItem",
    "Metadata",
    "ResponseCancel",
    "ResponseCreate",
    "ResponseParams",
    "SessionConfig",
    "SessionUpdate",
)


# ---------------------------------------------------------------- shared item shapes


class ContentPart(Struct, omit_defaults=True):
    type: Literal["input_text", "input_image", "output_text", "text"]
    text: str | None = None
    image_url: str | None = None  # data URL, or visiongate:sha256:<hex> for an image already seen
    detail: Literal["auto", "low", "high"] | None = None


# what a client may name or attach: ids it picks (events, items, responses) and response
# metadata, bounded as OpenAI bounds them, so nothing of any size is stored or echoed
MAX_ID_CHARS = 128
ClientId = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
Metadata = Annotated[
    dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
    msgspec.Meta(max_length=16),
]


class MessageItem(Struct, tag="message", tag_field="type", omit_defaults=True):
    role: Literal["user", "system", "assistant"]
    content: list[ContentPart]
    id: ClientId | None = None
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None


class FunctionCallItem(Struct, tag="function_call", tag_field="type", omit_defaults=True):
    """A call the model made (in a response's output), or one a client replays."""

    name: str
    arguments: str  # JSON text, as the model wrote it
    call_id: ClientId | None = None
    id: ClientId | None = None
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None


class FunctionCallOutputItem(
    Struct, tag="function_call_output", tag_field="type", omit_defaults=True
):
    """A tool's result, answering the call `call_id`."""

    call_id: ClientId
    output: str
    id: ClientId | None = None
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None


class ItemReference(Struct, tag="item_reference", tag_field="type"):
    """In `response.input`: an item of the conversation, by id."""

    id: ClientId


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ItemReference


# ---------------------------------------------------------------- client events


class SessionConfig(Struct, omit_defaults=True):
    type: Literal["realtime"] = "realtime"
    model: str | None = None  # when given, the served model's id; another: model_not_found
    instructions: str | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    output_modalities: list[Literal["text", "audio"]] | None = None
    # visiongate extensions (sampling is per session here, as in the beta Realtime API)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    # when the conversation outgrows the context: "auto" leaves out the oldest turns for the
    # model (the session keeps them), "disabled" refuses with context_length_exceeded
    truncation: Literal["auto", "disabled"] | None = None
    # function tools ({"type": "function", name, description, parameters}) and how the model
    # chooses among them; checked by `gateway.chat.output_grammar`, which names the field
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class ResponseParams(Struct, omit_defaults=True):
    instructions: str | None = None
    # the context of this response instead of the conversation (never stored in it)
    input: list[InputItem] | None = None
    tools: list[Any] | None = None  # replace the session's for this response
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    output_modalities: list[Literal["text", "audio"]] | None = None
    conversation: str | None = None  # "auto" (default) or "none"
    metadata: Metadata | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None


class SessionUpdate(Struct, tag="session.update", tag_field="type"):
    session: SessionConfig
    event_id: ClientId | None = None


class ConversationItemCreate(Struct, tag="conversation.item.create", tag_field="type"):
    item: Item
    event_id: ClientId | None = None
    previous_item_id: ClientId | None = None


class ResponseCreate(Struct, tag="response.create", tag_field="type"):
    event_id: ClientId | None = None
    response: ResponseParams | None = None


class ResponseCancel(Struct, tag="response.cancel", tag_field="type"):
    event_id: ClientId | None = None
    response_id: ClientId | None = None


class ConversationItemRetrieve(Struct, tag="conversation.item.retrieve", tag_field="type"):
    item_id: ClientId
    event_id: ClientId | None = None


class ConversationItemDelete(Struct, tag="conversation.item.delete", tag_field="type"):
    item_id: ClientId
    event_id: ClientId | None = None


class ConversationItemTruncate(Struct, tag="conversation.item.truncate", tag_field="type"):
    item_id: ClientId
    content_index: int
    audio_end_ms: int
    event_id: ClientId | None = None


ClientEvent = (
    SessionUpdate
    | ConversationItemCreate
    | ConversationItemRetrieve
    | ConversationItemDelete
    | ConversationItemTruncate
    | ResponseCreate
    | ResponseCancel
)
CLIENT_EVENT_TYPES = frozenset(
    (
        "session.update",
        "conversation.item.create",
        "conversation.item.retrieve",
        "conversation.item.delete",
        "conversation.item.truncate",
        "response.create",
        "response.cancel",
    )
)
