"""Chat Completions messages <-> a session's stored items.

OpenAI clients send the whole conversation on every request. With a session, the gateway
keeps the conversation too; `reconcile` appends only what is new when the stored items are a
prefix of the request's messages, and otherwise replaces them with the request's. Either way
the answer is the same, since the engine verifies KV reuse by content; the session only makes
the reuse (and the per-session bookkeeping) likely.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.http.protocol import ImageUrlPart, InputMessage, RefusalPart, TextPart
from gateway.image_input import ImageRef, digest_of, parse_image_url, sniff_image
from gateway.protocol.errors import GatewayError
from gateway.sessions.session import Session, StoredItem, StoredPart, new_id

__all__ = ("Conversation", "parse_messages", "reconcile", "same_item")


@dataclass(slots=True)
class Conversation:
    """A request's messages as the gateway stores them."""

    instructions: str | None  # the leading system/developer messages, joined; None if absent
    items: list[StoredItem]
    inline: dict[str, bytes] = field(default_factory=dict)  # digest -> bytes sent in this request
    refs: dict[str, str] = field(default_factory=dict)  # digest -> param, for images sent by digest


def image_urls(messages: list[InputMessage]) -> list[str]:
    """Every image URL the messages hold, in order."""
    return [part.image_url.url for m in messages if isinstance(m.content, list)
            for part in m.content if isinstance(part, ImageUrlPart)]


def parse_messages(messages: list[InputMessage], *, max_image_bytes: int, max_pixels: int,
                   max_images: int, fetched: Mapping[str, bytes] | None = None,
                   max_text_chars: int = 65536) -> Conversation:
    """Validate and convert. Images are checked from their header only (format, size); remote
    URLs resolve only through `fetched` (the allow-listed ones already downloaded)."""
    if not messages:
        raise GatewayError("invalid_request", "messages must hold at least one message",
                           param="messages")
    conv = Conversation(instructions=None, items=[])
    leading: list[str] = []
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        role = "system" if message.role == "developer" else message.role
        parts = _parts(message, param, conv, max_image_bytes=max_image_bytes, max_pixels=max_pixels,
                       fetched=fetched)
        for part in parts:
            if part.text is not None and len(part.text) > max_text_chars:
                raise GatewayError("input_too_large", f"text parts hold at most {max_text_chars} "
                                   "characters", param=f"{param}.content")
        if role == "system" and not conv.items:
            # system messages before the conversation are its instructions
            leading.append("\n".join(p.text or "" for p in parts))
            continue
        conv.items.append(StoredItem(id=new_id("item"), role=role, parts=parts))
    if leading:
        conv.instructions = "\n\n".join(leading)
    if not conv.items:
        raise GatewayError("invalid_request", "messages must hold at least one user message",
                           param="messages")
    if len(set(conv.inline) | set(conv.refs)) > max_images:
        raise GatewayError("too_many_images", f"a conversation holds at most {max_images} images",
                           param="messages")
    return conv


def _parts(message: InputMessage, param: str, conv: Conversation, *, max_image_bytes: int,
           max_pixels: int, fetched: Mapping[str, bytes] | None) -> list[StoredPart]:
    content = message.content
    if content is None:
        if message.role != "assistant":
            raise GatewayError("invalid_request", f"{message.role} messages need content",
                               param=f"{param}.content")
        return [StoredPart("text", text="")]
    if isinstance(content, str):
        return [StoredPart("text", text=content)]
    if not content:
        raise GatewayError("invalid_request", "content must hold at least one part",
                           param=f"{param}.content")
    parts: list[StoredPart] = []
    for j, part in enumerate(content):
        where = f"{param}.content[{j}]"
        if isinstance(part, TextPart):
            parts.append(StoredPart("text", text=part.text))
        elif isinstance(part, RefusalPart):
            if message.role != "assistant":
                raise GatewayError("invalid_request", "only assistant messages hold refusals",
                                   param=f"{where}.type")
            parts.append(StoredPart("text", text=part.refusal))
        elif isinstance(part, ImageUrlPart):
            if message.role != "user":
                raise GatewayError("invalid_request", "only user messages may hold images",
                                   param=f"{where}.type")
            parts.append(StoredPart("image", digest=_image(part.image_url.url, f"{where}.image_url.url",
                                                           conv, max_image_bytes, max_pixels, fetched)))
    return parts


def _image(url: str, param: str, conv: Conversation, max_image_bytes: int, max_pixels: int,
           fetched: Mapping[str, bytes] | None) -> str:
    ref = parse_image_url(url, max_bytes=max_image_bytes, param=param, fetched=fetched)
    if isinstance(ref, ImageRef):
        conv.refs.setdefault(str(ref), param)
        return str(ref)
    digest = digest_of(ref)
    if digest not in conv.inline:  # a repeated image is checked once
        sniff_image(ref, max_bytes=max_image_bytes, max_pixels=max_pixels, param=param)
        conv.inline[digest] = bytes(ref)
    return digest


def same_item(stored: StoredItem, sent: StoredItem) -> bool:
    """Same role and the same parts (texts and image digests); ids and status don't matter."""
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
