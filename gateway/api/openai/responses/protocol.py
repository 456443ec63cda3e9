"""Wire shapes of the Responses API (`/v1/responses`): request, response object, stream events.

The request Struct names every parameter the official SDK sends; anything else is refused as
an unknown field, and the parameters the gateway cannot honour are refused by the serving
layer with a clear message (those that change nothing, such as `user` or `service_tier`, are
accepted and ignored). The body is decoded by `decode_request`, so that a refusal names the
field in the caller's terms, an unknown one included.

Input items arrive as plain objects and are typed one by one (`convert_items`: messages,
`function_call` and `function_call_output`), so that an error names the item
(`input[2].content[0].image_url`) and an unknown item type is refused by name; `parse_input`
then checks them in the request layer (`gateway.chat.requests`) and turns them into the
session's stored items. Not here: sessions, chains and the answer itself (`http/responses`).

The response object and the events follow `openai.types.responses` field for field; fields the
SDK requires are always sent. visiongate's report of a response is the extra `visiongate`
object, as on chat completions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from msgspec import Struct

from gateway.chat.image_input import REF_PREFIX
from gateway.chat.requests import (
    ContentPart,
    RequestLimits,
    check_conversation_size,
    check_image_count,
    check_item_count,
    check_text,
    conversation_chars,
    parse_content,
)
from gateway.protocol.errors import GatewayError, clip
from gateway.protocol.report import CacheReport, Timings
from gateway.sessions.session import StoredItem, StoredPart, new_id

__all__ = (
    "FunctionCall",
    "FunctionCallInput",
    "FunctionCallOutputInput",
    "IncompleteDetails",
    "InputImage",
    "InputItemList",
    "InputText",
    "Logprob",
    "MessageInput",
    "OutputItem",
    "OutputMessage",
    "OutputText",
    "ParsedInput",
    "ResponseDeleted",
    "ResponseError",
    "ResponseEvent",
    "ResponseExtension",
    "ResponseObject",
    "ResponseUsage",
    "ResponsesRequest",
    "TextConfig",
    "convert_items",
    "decode_request",
    "event_type",
    "image_parts",
    "parse_input",
)


# ---------------------------------------------------------------- request


class TextConfig(Struct, forbid_unknown_fields=True):
    format: dict[str, Any] | None = None
    verbosity: str | None = None  # accepted and ignored


class ResponsesRequest(Struct, forbid_unknown_fields=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # None: true
    stream: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    # refused when given (the serving layer says why)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    max_tool_calls: int | None = None
    background_options: Any = None
    # accepted and ignored: they change nothing about what this gateway answers
    reasoning: dict[str, Any] | None = None  # the served model does not reason (noted)
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    stream_options: Any = None
    access_programs: Any = None
    image: Any = None


# input items, converted one by one from the request's plain objects


class InputText(Struct, tag="input_text", tag_field="type"):
    text: str
    prompt_cache_breakpoint: Any = None


class InputImage(Struct, tag="input_image", tag_field="type"):
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high", "original"] | None = None
    prompt_cache_breakpoint: Any = None


class InputFile(Struct, tag="input_file", tag_field="type"):
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None


class InputOutputText(Struct, tag="output_text", tag_field="type"):
    """An earlier answer's text, sent back as history."""

    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputRefusal(Struct, tag="refusal", tag_field="type"):
    refusal: str


InputContent = InputText | InputImage | InputFile | InputOutputText | InputRefusal


class MessageInput(Struct, forbid_unknown_fields=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputContent]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallInput(Struct, forbid_unknown_fields=True):
    """A call the model made earlier, sent back as history."""

    call_id: str
    name: str
    arguments: str
    type: Literal["function_call"] = "function_call"
    id: str | None = None
    status: str | None = None
    namespace: str | None = None
    caller: Any = None


class FunctionCallOutputInput(Struct, forbid_unknown_fields=True):
    """What the client's function returned for a call."""

    call_id: str
    output: str | list[dict[str, Any]]
    type: Literal["function_call_output"] = "function_call_output"
    id: str | None = None
    status: str | None = None
    name: str | None = None
    namespace: str | None = None
    caller: Any = None


# ---------------------------------------------------------------- response object


class TopLogprob(Struct):
    token: str
    bytes: list[int]
    logprob: float


class Logprob(Struct):
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob]


class OutputText(Struct, tag="output_text", tag_field="type", omit_defaults=True):
    text: str
    annotations: list[Any]
    logprobs: list[Logprob] | None = None  # only when include asks for them


class OutputMessage(Struct, tag="message", tag_field="type"):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"


class FunctionCall(Struct, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | FunctionCall


class InputTokensDetails(Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct):
    reason: Literal["max_output_tokens", "content_filter"] | None = None


class ResponseError(Struct):
    """`code` is from OpenAI's vocabulary for failed responses; `type` holds visiongate's
    stable code (a key of ERROR_CODES)."""

    code: str
    message: str
    param: str | None = None
    type: str | None = None


class ResponseExtension(Struct, omit_defaults=True):
    """visiongate's report of one response: timings, cache results, where it lives."""

    timings: Timings
    cache: CacheReport
    image_tokens: int = 0
    image_tokens_total: int = 0
    session_id: str | None = None  # the session holding the chain (None: store=false)
    truncated_items: int = 0
    stored: bool | None = None  # with store: whether answer and record were both stored
    forked: bool = False  # the previous response had been continued already: a new session
    notes: list[str] = []  # parameters accepted but not applied, in words


class ResponseObject(Struct):
    id: str
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress", "cancelled"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    previous_response_id: str | None
    store: bool
    metadata: dict[str, str]
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None
    text: dict[str, Any]
    truncation: Literal["auto", "disabled"]
    top_logprobs: int | None = None
    user: str | None = None
    background: bool = False
    reasoning: dict[str, Any] | None = None
    service_tier: str = "default"
    object: Literal["response"] = "response"
    visiongate: ResponseExtension | None = None


class ResponseDeleted(Struct):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputItemList(Struct):
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


# ---------------------------------------------------------------- stream events


class ResponseEvent(Struct, tag_field="type"):
    """Base of the stream events: each is sent as `event: <type>` with its JSON as data."""

    sequence_number: int


class ResponseCreated(ResponseEvent, tag="response.created"):
    response: ResponseObject


class ResponseInProgress(ResponseEvent, tag="response.in_progress"):
    response: ResponseObject


class ResponseCompleted(ResponseEvent, tag="response.completed"):
    response: ResponseObject


class ResponseIncomplete(ResponseEvent, tag="response.incomplete"):
    response: ResponseObject


class ResponseFailed(ResponseEvent, tag="response.failed"):
    response: ResponseObject


class OutputItemAdded(ResponseEvent, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(ResponseEvent, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(ResponseEvent, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(ResponseEvent, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(ResponseEvent, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Logprob]


class OutputTextDone(ResponseEvent, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Logprob]


class ArgumentsDelta(ResponseEvent, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(ResponseEvent, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str
    name: str


def event_type(event: ResponseEvent) -> str:
    """The `type` an event is sent with (its tag)."""
    return str(type(event).__struct_config__.tag)


# ---------------------------------------------------------------- input items -> stored items

InputItem = MessageInput | FunctionCallInput | FunctionCallOutputInput
_ITEM_SHAPES: dict[str, type[InputItem]] = {
    "message": MessageInput,
    "function_call": FunctionCallInput,
    "function_call_output": FunctionCallOutputInput,
}


@dataclass(slots=True)
class ParsedInput:
    """A request's input as the gateway stores it, and the images it brings."""

    items: list[StoredItem] = field(default_factory=list)
    views: list[dict[str, Any]] = field(default_factory=list)  # as /input_items lists them
    inline: dict[str, bytes] = field(default_factory=dict)  # digest -> bytes sent inline
    refs: dict[str, str] = field(default_factory=dict)  # digest -> param, images sent by digest


def _invalid(message: str, param: str) -> GatewayError:
    return GatewayError("invalid_request", message, param=param)


_request_decoder = msgspec.json.Decoder(ResponsesRequest)
_FIELD = re.compile(r"Object (?:contains unknown|missing required) field `(.+)`")


def decode_request(body: bytes) -> ResponsesRequest:
    """The request body, decoded and typed; refusals name the field (an unknown one too)."""
    try:
        return _request_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise _refusal(exc, "") from None
    except msgspec.DecodeError as exc:
        raise GatewayError("invalid_json", f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise GatewayError("invalid_json", "the body is nested too deeply") from None


def _refusal(exc: msgspec.ValidationError, where: str) -> GatewayError:
    """msgspec's "<what> - at `$.path`" as an invalid_request naming `where` + path."""
    message, _, path = str(exc).partition(" - at `$")
    path = path.rstrip("`")
    named = _FIELD.fullmatch(message)
    if named:
        path = f"{path}.{named[1]}"
    return GatewayError("invalid_request", message, param=(where + path).lstrip(".") or None)


def convert_items(
    value: str | list[dict[str, Any]], limits: RequestLimits
) -> list[tuple[InputItem, list[ContentPart]]]:
    """The input's items in their typed shapes, each message with its parts (in the request
    layer's terms, so the images can be counted and fetched before anything is parsed)."""
    if isinstance(value, str):
        return [(MessageInput(role="user", content=value), [ContentPart("text", "input", value)])]
    if not value:
        raise _invalid("input must hold at least one item", "input")
    check_item_count(len(value), limits, "input")
    out: list[tuple[InputItem, list[ContentPart]]] = []
    for i, raw in enumerate(value):
        where = f"input[{i}]"
        kind = raw.get("type", "message")
        if kind == "item_reference":
            raise _invalid(
                "item references are not supported; continue a conversation with "
                "previous_response_id",
                f"{where}.type",
            )
        shape = _ITEM_SHAPES.get(kind) if isinstance(kind, str) else None
        if shape is None:
            raise _invalid(
                f"input items of type {clip(kind, 64)!r} are not supported (message, "
                "function_call and function_call_output are)",
                f"{where}.type",
            )
        try:
            item = msgspec.convert(raw, shape)
        except msgspec.ValidationError as exc:
            raise _refusal(exc, where) from None
        parts = _message_parts(item, where) if isinstance(item, MessageInput) else []
        out.append((item, parts))
    return out


def image_parts(items: list[tuple[InputItem, list[ContentPart]]]) -> list[ContentPart]:
    return [part for _, parts in items for part in parts if part.kind == "image"]


def _message_parts(message: MessageInput, where: str) -> list[ContentPart]:
    content = message.content
    if isinstance(content, str):
        return [ContentPart("text", f"{where}.content", text=content)]
    parts: list[ContentPart] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = f"{at}.type"
        if isinstance(part, InputText):
            parts.append(ContentPart("text", f"{at}.text", text=part.text, type_param=kind))
        elif isinstance(part, (InputOutputText, InputRefusal)):
            if message.role != "assistant":
                raise _invalid(f"only assistant messages hold {part.__struct_config__.tag}", kind)
            text = part.text if isinstance(part, InputOutputText) else part.refusal
            parts.append(ContentPart("text", at, text=text, type_param=kind))
        elif isinstance(part, InputImage):
            if part.image_url is None:
                raise _invalid(
                    "images by file_id are not supported; send image_url: a data URL, an "
                    "allow-listed URL, or visiongate:sha256:<digest> from POST /v1/images"
                    if part.file_id
                    else "an input_image needs image_url",
                    f"{at}.file_id" if part.file_id else f"{at}.image_url",
                )
            parts.append(
                ContentPart("image", f"{at}.image_url", url=part.image_url, type_param=kind)
            )
        else:
            raise _invalid("file inputs are not supported; send text and images", kind)
    return parts


def parse_input(
    items: list[tuple[InputItem, list[ContentPart]]],
    limits: RequestLimits,
    fetched: Mapping[str, bytes] | None = None,
) -> ParsedInput:
    """Check the input and turn it into stored items: messages (developer is system), and the
    history of tool use. Calls the model made (`function_call`) join the assistant message
    before them, as the service stores an answer that called tools; a call's result
    (`function_call_output`) is a "tool" item. Remote image URLs resolve only through
    `fetched` (the allow-listed ones already downloaded)."""
    out = ParsedInput()
    for i, (item, parts) in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, MessageInput):
            role = "system" if item.role == "developer" else item.role
            parsed = parse_content(role, parts, limits, fetched, param=f"{where}.content")
            for digest, data in parsed.inline.items():
                out.inline.setdefault(digest, data)
            for digest, param in parsed.refs.items():
                out.refs.setdefault(digest, param)
            stored = StoredItem(id=new_id("msg"), role=role, parts=parsed.parts)
            out.items.append(stored)
            out.views.append(_message_view(stored, item.role))
        elif isinstance(item, FunctionCallInput):
            if not item.name:
                raise _invalid("a function_call needs a name", f"{where}.name")
            call = StoredPart(
                "tool_call",
                text=check_text(item.arguments, limits, f"{where}.arguments"),
                name=item.name,
                call_id=item.call_id,
            )
            last = out.items[-1] if out.items else None
            if last is not None and last.role == "assistant":
                last.parts.append(call)
            else:
                out.items.append(StoredItem(id=new_id("msg"), role="assistant", parts=[call]))
            out.views.append(
                {
                    "id": new_id("fc"),
                    "type": "function_call",
                    "call_id": item.call_id,
                    "name": item.name,
                    "arguments": item.arguments,
                    "status": "completed",
                }
            )
        else:
            text = _output_text(item, where)
            check_text(text, limits, f"{where}.output")
            result = StoredPart("text", text=text, call_id=item.call_id)
            stored = StoredItem(id=new_id("fco"), role="tool", parts=[result])
            out.items.append(stored)
            out.views.append(
                {
                    "id": stored.id,
                    "type": "function_call_output",
                    "call_id": item.call_id,
                    "output": text,
                    "status": "completed",
                }
            )
    check_image_count(set(out.inline) | set(out.refs), limits, "input")
    check_conversation_size(conversation_chars(None, out.items), limits, "input")
    return out


def _output_text(item: FunctionCallOutputInput, where: str) -> str:
    if isinstance(item.output, str):
        return item.output
    texts: list[str] = []
    for j, part in enumerate(item.output):
        if part.get("type") != "input_text" or not isinstance(part.get("text"), str):
            raise _invalid(
                "a function_call_output holds a string or input_text parts",
                f"{where}.output[{j}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def _message_view(item: StoredItem, role: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    for part in item.parts:
        if role == "assistant":
            content.append({"type": "output_text", "text": part.text or "", "annotations": []})
        elif part.kind == "image":
            content.append(
                {
                    "type": "input_image",
                    "image_url": REF_PREFIX + (part.digest or ""),
                    "detail": "auto",
                }
            )
        else:
            content.append({"type": "input_text", "text": part.text or ""})
    return {
        "id": item.id,
        "type": "message",
        "role": role,
        "status": "completed",
        "content": content,
    }
