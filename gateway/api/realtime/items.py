"""Realtime conversation items <-> a session's stored items, and the tools a response may call.

A Realtime conversation is a list of items, each one `StoredItem`:
- a `message`: its role and parts (text and images);
- a `function_call`: an assistant item of one `tool_call` part (name, arguments, call_id);
- a `function_call_output`: a "tool" item of one text part carrying the call_id it answers.

The service stores an answer given with tools as one assistant item of text and calls, as Chat
Completions' assistant message with `tool_calls` reads; `split_answer_item` turns it into the
items the response showed (the message, then one item per call: ids `<item>`, `<item>_1`, ...).
`joined` puts them back together for the model: a function_call item joins the assistant
message before it, so the prompt is the one Chat Completions renders for the same history
(assistant `tool_calls`, then `tool` messages), and a greedy answer is token-identical.

Tools are the Realtime API's function tools (`{"type": "function", name, description,
parameters}`), planned by `gateway.chat.output_grammar` as for the HTTP APIs: the same prompt and
the
same constrained decoding. A Realtime tool has no `strict`: unsupported schema keywords are
ignored unless the client sends `"strict": true`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from gateway.api.realtime import protocol as rt
from gateway.chat.image_input import REF_PREFIX
from gateway.chat.output_grammar import ToolPlan, plan_tools, tools_from_responses
from gateway.chat.requests import (
    ContentPart,
    ParsedContent,
    RequestLimits,
    add_inline_images,
    admit_encodes,
    check_conversation_size,
    check_image_count,
    check_item_count,
    check_tool_result,
    conversation_chars,
    fetch_remote,
    parse_content,
    resolve_references,
    tool_call_part,
    tool_result_part,
)
from gateway.protocol.errors import GatewayError, clip
from gateway.sessions.session import StoredItem, StoredPart, new_id

if TYPE_CHECKING:
    from gateway.chat.vision_resolver import EncodePermit, EncodeQuota, VisionResolver

__all__ = (
    "call_ids",
    "check_placement",
    "content_parts",
    "delete_item",
    "find_item",
    "input_context",
    "is_call",
    "joined",
    "output_item_id",
    "parse_item",
    "plan_realtime_tools",
    "split_answer_item",
    "stored_role",
    "truncate_item",
    "wire_item",
)


def output_item_id(item_id: str, index: int) -> str:
    """The id of a response's `index`th output item (`item_id`: the answer's own)."""
    return item_id if index == 0 else f"{item_id}_{index}"


def is_call(item: StoredItem) -> bool:
    """A function_call item: an assistant item holding calls and nothing else."""
    return (
        item.role == "assistant"
        and bool(item.parts)
        and all(part.kind == "tool_call" for part in item.parts)
    )


def wire_item(item: StoredItem) -> rt.Item:
    """A stored item as the Realtime API shows it; images appear as digest references."""
    status = item.status
    if item.role == "tool":
        part = item.parts[0] if item.parts else StoredPart("text", text="")
        return rt.FunctionCallOutputItem(
            call_id=part.call_id or "",
            output="".join(p.text or "" for p in item.parts),
            id=item.id,
            object="realtime.item",
            status=status,
        )
    if is_call(item):
        part = item.parts[0]
        return rt.FunctionCallItem(
            name=part.name or "",
            arguments=part.text or "",
            call_id=part.call_id,
            id=item.id,
            object="realtime.item",
            status=status,
        )
    parts: list[rt.ContentPart] = []
    for part in item.parts:
        if part.kind == "image":
            parts.append(rt.ContentPart("input_image", image_url=f"{REF_PREFIX}{part.digest}"))
        elif part.kind == "tool_call":  # an answer not split (its client went away mid-call)
            continue
        elif item.role == "assistant":
            parts.append(rt.ContentPart("output_text", text=part.text))
        else:
            parts.append(rt.ContentPart("input_text", text=part.text))
    return rt.MessageItem(
        role=item.role,  # type: ignore[arg-type]
        content=parts,
        id=item.id,
        object="realtime.item",
        status=status,
    )


def stored_role(item: rt.Item) -> str:
    if isinstance(item, rt.MessageItem):
        return item.role
    return "assistant" if isinstance(item, rt.FunctionCallItem) else "tool"


def content_parts(item: rt.MessageItem, param: str = "item") -> list[ContentPart]:
    """A message's content as the request layer's parts, named in Realtime terms."""
    parts: list[ContentPart] = []
    for index, part in enumerate(item.content):
        at = f"{param}.content[{index}]"
        if part.type == "input_image":
            parts.append(
                ContentPart("image", f"{at}.image_url", url=part.image_url, type_param=f"{at}.type")
            )
        else:
            parts.append(ContentPart("text", f"{at}.text", text=part.text, type_param=f"{at}.type"))
    return parts


def parse_item(
    item: rt.Item,
    limits: RequestLimits,
    fetched: dict[str, bytes] | None,
    calls: Iterable[str],
    *,
    param: str = "item",
) -> ParsedContent:
    """Check a client's item and turn it into stored parts. `calls`: the ids of the calls a
    function_call_output may answer (those of the conversation it joins)."""
    if isinstance(item, rt.MessageItem):
        parts = content_parts(item, param)
        return parse_content(item.role, parts, limits, fetched, param=f"{param}.content")
    if isinstance(item, rt.FunctionCallItem):
        part = tool_call_part(
            item.call_id if item.call_id is not None else new_id("call"),
            item.name,
            item.arguments,
            limits,
            params=(f"{param}.call_id", f"{param}.name", f"{param}.arguments"),
        )
        return ParsedContent(parts=[part])
    check_tool_result(item.call_id, calls, f"{param}.call_id")
    part = tool_result_part(
        item.call_id, item.output, limits, params=(f"{param}.call_id", f"{param}.output")
    )
    return ParsedContent(parts=[part])


def call_ids(items: Iterable[StoredItem]) -> list[str]:
    return [p.call_id for i in items for p in i.parts if p.kind == "tool_call" and p.call_id]


def find_item(items: Sequence[StoredItem], item_id: str, param: str = "item_id") -> StoredItem:
    for item in items:
        if item.id == item_id:
            return item
    raise GatewayError(
        "item_not_found", f"no item {clip(item_id, 128)!r} in the conversation", param=param
    )


def _refuse_in_progress(item: StoredItem) -> None:
    if item.status == "in_progress":
        raise GatewayError(
            "invalid_request",
            f"item {item.id!r} is still being written by a response; cancel it or wait for "
            "response.done",
            param="item_id",
        )


def _refuse_read(items: Sequence[StoredItem], item: StoredItem) -> None:
    """An item before an answer still being written is that response's context: taking it
    out now would store the answer without what it answers."""
    index = next(n for n, i in enumerate(items) if i is item)
    for later in items[index + 1 :]:
        if later.status == "in_progress":
            raise GatewayError(
                "invalid_request",
                f"item {item.id!r} is read by the response writing item {later.id!r}; cancel "
                "it or wait for response.done",
                param="item_id",
            )


def check_placement(items: Sequence[StoredItem], index: int, param: str = "item") -> None:
    """The item at `index` keeps calls and results paired: a function_call_output comes after
    the call it answers, and a function_call's id is the only one of its conversation."""
    item = items[index]
    call_id = item.parts[0].call_id if item.parts else None
    if item.role == "tool" and call_id is not None:
        check_tool_result(call_id, call_ids(items[:index]), f"{param}.call_id")
    elif is_call(item) and call_id in call_ids([*items[:index], *items[index + 1 :]]):
        raise GatewayError(
            "invalid_request",
            f"the conversation already holds a function_call with call_id {clip(call_id, 64)!r}",
            param=f"{param}.call_id",
        )


def delete_item(items: list[StoredItem], item_id: str) -> None:
    """Remove an item; not one a response in progress writes or reads, nor a function_call
    whose output is still in the conversation (the output would answer nothing)."""
    item = find_item(items, item_id)
    _refuse_in_progress(item)
    _refuse_read(items, item)
    if is_call(item):
        answered = set(call_ids([item]))
        for other in items:
            if other.role == "tool" and any(p.call_id in answered for p in other.parts):
                raise GatewayError(
                    "invalid_request",
                    f"item {other.id!r} is this call's output: delete it first",
                    param="item_id",
                )
    items.remove(item)


def truncate_item(
    items: list[StoredItem], item_id: str, content_index: int, audio_end_ms: int
) -> None:
    """Take an assistant message's text out of the context. Text items hold no audio, so
    `audio_end_ms` is 0 (nothing of the item was heard) and the part's text is removed, as the
    Realtime API removes the transcript of audio not yet played."""
    item = find_item(items, item_id)
    if item.role != "assistant" or is_call(item):
        raise GatewayError(
            "invalid_request", "only assistant messages can be truncated", param="item_id"
        )
    _refuse_in_progress(item)
    _refuse_read(items, item)
    if not 0 <= content_index < len(item.parts):
        raise GatewayError(
            "invalid_request",
            f"the item has no content part {content_index}",
            param="content_index",
        )
    if audio_end_ms != 0:
        raise GatewayError(
            "invalid_request",
            "the item holds no audio: audio_end_ms must be 0",
            param="audio_end_ms",
        )
    item.parts[content_index] = StoredPart("text", text="")


async def input_context(
    items: list[rt.InputItem],
    conversation: Sequence[StoredItem],
    limits: RequestLimits,
    vision: VisionResolver,
    *,
    owner: str,
    started: set[str],
    quota: EncodeQuota,
) -> tuple[list[StoredItem], EncodePermit]:
    """`response.input`: the items of one response's context, each checked as
    `conversation.item.create` checks one; `item_reference` names an item of `conversation`.
    Its images are stored for `owner` and admitted for encoding (but those in `started`,
    already encoding); the permit holds their slots until the caller closes it."""
    check_item_count(len(items), limits, "response.input")
    context: list[StoredItem] = []
    inline: dict[str, bytes] = {}
    refs: dict[str, str] = {}
    for index, item in enumerate(items):
        param = f"response.input[{index}]"
        if isinstance(item, rt.ItemReference):
            context.append(find_item(conversation, item.id, f"{param}.id"))
            continue
        fetched = None
        if isinstance(item, rt.MessageItem):
            parts = content_parts(item, param)
            fetched = await fetch_remote(parts, limits, param=f"{param}.content")
        parsed = parse_item(item, limits, fetched, call_ids(context), param=param)
        inline.update(parsed.inline)
        refs.update(parsed.refs)
        item_id = item.id or new_id("item")
        context.append(StoredItem(id=item_id, role=stored_role(item), parts=parsed.parts))
        check_placement(context, len(context) - 1, param)
    digests = {p.digest for i in context for p in i.parts if p.kind == "image" and p.digest}
    check_image_count(digests, limits, "response.input")
    check_conversation_size(conversation_chars(None, context), limits, "response.input")
    await resolve_references(refs, vision, owner=owner)
    starts = (set(inline) | set(refs)) - started
    permit = await admit_encodes(starts, vision, owner=owner, also=(quota,))
    try:
        await add_inline_images(inline, vision, owner=owner)
    except BaseException:
        permit.close()
        raise
    return context, permit


def joined(items: Iterable[StoredItem]) -> list[StoredItem]:
    """The items as the model reads them: each function_call item joins the assistant message
    before it (text first, then the calls, as one answer that called tools)."""
    out: list[StoredItem] = []
    for item in items:
        last = out[-1] if out else None
        if (
            is_call(item)
            and last is not None
            and last.role == "assistant"
            and last.status != "in_progress"
            and item.status != "in_progress"
        ):
            out[-1] = msgspec.structs.replace(last, parts=[*last.parts, *item.parts])
        else:
            out.append(item)
    return out


def split_answer_item(items: list[StoredItem], item_id: str) -> None:
    """Make the stored answer `item_id` the items its response showed: its text (if any) as a
    message, then one function_call item per call, ids as `output_item_id` numbers them."""
    for index, item in enumerate(items):
        if item.id != item_id:
            continue
        calls = [p for p in item.parts if p.kind == "tool_call"]
        if not calls:
            return
        text = [p for p in item.parts if p.kind != "tool_call"]
        pieces = [text] if text else []
        pieces += [[call] for call in calls]
        items[index : index + 1] = [
            StoredItem(
                id=output_item_id(item_id, n),
                role="assistant",
                parts=parts,
                status=item.status,
                response_id=item.response_id,
            )
            for n, parts in enumerate(pieces)
        ]
        return


def plan_realtime_tools(
    tools: list[Any] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    *,
    tools_param: str,
    choice_param: str,
    budget: int | None = None,
) -> ToolPlan | None:
    """The prompt and grammar for Realtime function tools; None when there are none and the
    choice needs none (`"auto"`, `"none"`, or not given). `budget` (the answer's max tokens)
    bounds what the arguments' schemas leave unbounded, as over HTTP."""
    lenient = [
        {"type": "function", "strict": False, **tool} if isinstance(tool, dict) else tool
        for tool in tools or ()
    ]
    specs = tools_from_responses(lenient, param=tools_param) if lenient else []
    if not specs and tool_choice in (None, "auto", "none"):
        return None
    return plan_tools(specs, tool_choice, parallel_tool_calls, param=choice_param, budget=budget)
