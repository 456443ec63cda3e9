"""Chat Completions messages <-> a session's stored items.

`message_parts` translates a message's wire shape to the request layer's `ContentPart`s;
`parse_messages` checks them there (`gateway.chat.requests`) and gathers the conversation.
An assistant message's `tool_calls` become `tool_call` parts (after its text, if any); a `tool`
message becomes a "tool" item of one text part carrying the `tool_call_id` it answers.

OpenAI clients send the whole conversation on every request. With a session, the gateway
keeps the conversation too; `reconcile` appends only what is new when the stored items are a
prefix of the request's messages, and otherwise replaces them with the request's. Either way
the answer is the same, since the engine verifies KV reuse by content; the session only makes
the reuse (and the per-session bookkeeping) likely.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.api.openai.chat.protocol import ImageUrlPart, InputMessage, RefusalPart, TextPart
from gateway.chat.requests import (
    ContentPart,
    RequestLimits,
    check_conversation_size,
    check_image_count,
    check_instructions,
    check_tool_result,
    conversation_chars,
    parse_content,
    tool_call_part,
    tool_result_part,
)
from gateway.protocol.errors import GatewayError
from gateway.sessions.session import Session, StoredItem, StoredPart, new_id

__all__ = ("Conversation", "all_parts", "message_parts", "parse_messages", "reconcile", "same_item")


@dataclass(slots=True)
class Conversation:
    """A request's messages as the gateway stores them."""

    instructions: str | None  # the leading system/developer messages, joined; None if absent
    items: list[StoredItem]
    inline: dict[str, bytes] = field(default_factory=dict)  # digest -> bytes sent in this request
    refs: dict[str, str] = field(default_factory=dict)  # digest -> param, for images sent by digest


def message_parts(message: InputMessage, param: str) -> list[ContentPart]:
    """One message's content as the request layer's parts (`param`: "messages[i]")."""
    content, where = message.content, f"{param}.content"
    if content is None or (content == "" and message.tool_calls):
        # an assistant turn may be empty (or only call tools); the request layer refuses the rest
        if message.role == "assistant" and not message.tool_calls:
            return [ContentPart("text", where, text="")]
        return []
    if isinstance(content, str):
        return [ContentPart("text", where, text=content)]
    parts: list[ContentPart] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if isinstance(part, TextPart):
            parts.append(ContentPart("text", f"{at}.text", text=part.text, type_param=f"{at}.type"))
        elif isinstance(part, RefusalPart):
            if message.role != "assistant":
                raise GatewayError(
                    "invalid_request", "only assistant messages hold refusals", param=f"{at}.type"
                )
            parts.append(
                ContentPart("text", f"{at}.refusal", text=part.refusal, type_param=f"{at}.type")
            )
        elif isinstance(part, ImageUrlPart):
            parts.append(
                ContentPart(
                    "image", f"{at}.image_url.url", url=part.image_url.url, type_param=f"{at}.type"
                )
            )
    return parts


def all_parts(messages: list[InputMessage]) -> list[ContentPart]:
    """Every part of every message, in order (to count and fetch the images first)."""
    return [p for i, m in enumerate(messages) for p in message_parts(m, f"messages[{i}]")]


def parse_messages(
    messages: list[InputMessage], limits: RequestLimits, fetched: Mapping[str, bytes] | None = None
) -> Conversation:
    """Check and convert. Images are checked from their header only (format, size); remote
    URLs resolve only through `fetched` (the allow-listed ones already downloaded). A
    conversation of instructions alone is allowed: the model answers them."""
    if not messages:
        raise GatewayError(
            "invalid_request", "messages must hold at least one message", param="messages"
        )
    conv = Conversation(instructions=None, items=[])
    leading: list[str] = []
    calls: list[str] = []  # ids of the tool calls made so far, for the results that answer them
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        role = "system" if message.role == "developer" else message.role
        _refuse_misplaced_fields(message, param)
        parts = message_parts(message, param)
        stored: list[StoredPart] = []
        if parts or not (role == "assistant" and message.tool_calls):  # empty: refused there
            parsed = parse_content(role, parts, limits, fetched, param=f"{param}.content")
            stored = list(parsed.parts)
            for digest, data in parsed.inline.items():
                conv.inline.setdefault(digest, data)
            for digest, where in parsed.refs.items():
                conv.refs.setdefault(digest, where)
        if role == "system" and not conv.items:
            # system messages before the conversation are its instructions
            leading.append("\n".join(p.text or "" for p in stored))
            continue
        if role == "tool":
            stored = [_tool_result(message, stored, calls, limits, param)]
        for j, call in enumerate(message.tool_calls or ()):
            where = f"{param}.tool_calls[{j}]"
            part = tool_call_part(
                call.id,
                call.function.name,
                call.function.arguments,
                limits,
                params=(f"{where}.id", f"{where}.function.name", f"{where}.function.arguments"),
            )
            calls.append(part.call_id or "")
            stored.append(part)
        conv.items.append(StoredItem(id=new_id("item"), role=role, parts=stored))
    if leading:
        conv.instructions = check_instructions("\n\n".join(leading), limits, "messages")
    check_image_count(set(conv.inline) | set(conv.refs), limits, "messages")
    check_conversation_size(conversation_chars(conv.instructions, conv.items), limits, "messages")
    return conv


def _refuse_misplaced_fields(message: InputMessage, param: str) -> None:
    if message.function_call is not None:
        raise GatewayError(
            "invalid_request",
            "function_call is the legacy form of tool calls and is not supported; send tool_calls",
            param=f"{param}.function_call",
        )
    if message.tool_calls and message.role != "assistant":
        raise GatewayError(
            "invalid_request",
            "only assistant messages hold tool_calls",
            param=f"{param}.tool_calls",
        )
    if message.role == "tool" and message.tool_call_id is None:
        raise GatewayError(
            "invalid_request",
            "a tool message needs the tool_call_id of the call it answers",
            param=f"{param}.tool_call_id",
        )


def _tool_result(
    message: InputMessage,
    parts: list[StoredPart],
    calls: list[str],
    limits: RequestLimits,
    param: str,
) -> StoredPart:
    """A tool message's text parts joined into one part that names the call it answers."""
    where = f"{param}.tool_call_id"
    check_tool_result(message.tool_call_id or "", calls, where)
    return tool_result_part(
        message.tool_call_id,
        "".join(p.text or "" for p in parts),
        limits,
        params=(where, f"{param}.content"),
    )


def same_item(stored: StoredItem, sent: StoredItem) -> bool:
    """Same role and the same parts (texts, image digests, tool calls with their names,
    arguments and ids, the call a tool result answers); ids and status don't matter."""
    return stored.role == sent.role and stored.parts == sent.parts


def reconcile(session: Session, conv: Conversation, default_instructions: str) -> int:
    """Bring the session in line with the request; returns how many stored items were kept."""
    session.instructions = default_instructions if conv.instructions is None else conv.instructions
    stored = session.items
    if len(stored) <= len(conv.items) and all(map(same_item, stored, conv.items)):
        kept = len(stored)
        stored.extend(conv.items[kept:])
        return kept
    session.items = list(conv.items)
    return 0
