"""A Responses API request's body and input items, decoded and checked into stored items.

`decode_request` decodes the body so that a refusal names the field in the caller's terms (an
unknown one included). Input items arrive as plain objects and are typed one by one
(`convert_items`: messages, `function_call` and `function_call_output`), so that an error names
the item (`input[2].content[0].image_url`) and an unknown item type is refused by name;
`parse_input` checks them in the request layer (`gateway.chat.requests`) and turns them into
the session's stored items, with the images they bring and their views as `/input_items`
lists them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.api.openai.responses.protocol import (
    FunctionCallInput,
    FunctionCallOutputInput,
    InputImage,
    InputOutputText,
    InputRefusal,
    InputText,
    MessageInput,
    ResponsesRequest,
)
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
from gateway.sessions.session import StoredItem, StoredPart, new_id

__all__ = (
    "InputItem",
    "ParsedInput",
    "convert_items",
    "decode_request",
    "image_parts",
    "parse_input",
)


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
