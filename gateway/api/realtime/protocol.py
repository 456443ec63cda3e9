"""Realtime WebSocket events: the text-and-image subset of the OpenAI Realtime API.

Items are a tagged union on `type` as in the GA API: `message` (text and image parts),
`function_call` and `function_call_output`; `response.input` also takes `item_reference`.

Client events are one msgspec tagged union on `type`, decoded by decoders made once (JSON for
text frames, msgpack for binary frames under the `visiongate.v1.msgpack` subprotocol). Unknown
fields are ignored, so a client that sends the full Realtime shapes works unchanged. Server
events are Structs encoded with `omit_defaults`, so absent optional fields are left out.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Struct

from gateway.protocol.errors import GatewayError
from gateway.protocol.report import CacheReport, Timings

__all__ = (
    "ClientEvent",
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
    "ResponseCancel",
    "ResponseCreate",
    "SessionUpdate",
    "WireCodec",
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


class _Envelope(Struct):
    """What is read of a frame that failed full validation, to classify the error."""

    type: Any = None
    event_id: Any = None


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
)


# ---------------------------------------------------------------- codec

_PATH = re.compile(r" - at `\$\.?(.*)`$")


class WireCodec:
    """Decodes client frames and encodes server events, in JSON or msgpack. Made once per format."""

    __slots__ = ("_decode", "_decode_any", "_decode_envelope", "_encode", "binary")

    def __init__(self, *, binary: bool = False) -> None:
        self.binary = binary
        if binary:
            self._decode = msgspec.msgpack.Decoder(ClientEvent).decode
            self._decode_any = msgspec.msgpack.Decoder().decode
            self._decode_envelope = msgspec.msgpack.Decoder(_Envelope).decode
            self._encode = msgspec.msgpack.Encoder().encode
        else:
            self._decode = msgspec.json.Decoder(ClientEvent).decode
            self._decode_any = msgspec.json.Decoder().decode
            self._decode_envelope = msgspec.json.Decoder(_Envelope).decode
            self._encode = msgspec.json.Encoder().encode

    def encode(self, event: ServerEvent) -> bytes:
        return self._encode(event)

    def decode(self, frame: bytes | str) -> ClientEvent:
        """Parse one client frame, or raise GatewayError.

        The error's code is invalid_json, unknown_event or invalid_event.

        The raised error's `event_id` attribute carries the client's event_id when one could be
        read, so the error event can echo it.
        """
        if self.binary and isinstance(frame, str):
            raise _no_event_id(
                GatewayError("invalid_json", "this connection speaks msgpack: send binary frames")
            )
        try:
            return self._decode(frame)
        except msgspec.ValidationError as exc:
            # a frame that is not valid at all (or nested too deeply) is invalid_json, whatever
            # the typed decoder stumbled on first
            self._check_syntax(frame)
            envelope = self._envelope(frame)
            event_id = envelope.event_id
            if not isinstance(event_id, str) or len(event_id) > MAX_ID_CHARS:
                event_id = None  # never echo an id of any size
            kind = envelope.type
            if not isinstance(kind, str) or kind not in CLIENT_EVENT_TYPES:
                err = GatewayError(
                    "unknown_event" if isinstance(kind, str) else "invalid_event",
                    f"unknown event type {kind!r}; "
                    f"supported: {', '.join(sorted(CLIENT_EVENT_TYPES))}"
                    if isinstance(kind, str)
                    else "an event needs a string `type`",
                    param="type",
                )
            else:
                text = str(exc)
                match = _PATH.search(text)
                err = GatewayError(
                    "invalid_event",
                    f"invalid {kind}: {text}",
                    param=match.group(1) if match else None,
                )
            err.event_id = event_id  # type: ignore[attr-defined]
            raise err from None
        except msgspec.DecodeError as exc:
            raise _no_event_id(self._invalid(exc)) from None
        except RecursionError:  # arrays or maps nested deeper than any event has
            raise _no_event_id(GatewayError("invalid_json", "frame is nested too deeply")) from None

    def _invalid(self, exc: Exception) -> GatewayError:
        fmt = "msgpack" if self.binary else "JSON"
        return GatewayError("invalid_json", f"frame is not valid {fmt}: {exc}")

    def _check_syntax(self, frame: bytes | str) -> None:
        try:
            self._decode_any(frame)
        except msgspec.DecodeError as exc:
            raise _no_event_id(self._invalid(exc)) from None
        except RecursionError:
            raise _no_event_id(GatewayError("invalid_json", "frame is nested too deeply")) from None

    def _envelope(self, frame: bytes | str) -> _Envelope:
        try:
            return self._decode_envelope(frame)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            return _Envelope()


def _no_event_id(err: GatewayError) -> GatewayError:
    err.event_id = None  # type: ignore[attr-defined]
    return err
