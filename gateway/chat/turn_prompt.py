"""What one turn asks the engine: its messages, its sampling values and its cache namespaces.

`turn_messages` renders a stored conversation as the engine's messages: the instructions (with
the tools prompt after them), each item's text and images, a stored tool call as the text the
model wrote for it (`render_answer`) and a tool's result as a user turn in the tags the tools
prompt announces. An image goes as its visual tokens, named by the encoder's fingerprint and
its digest (new encoder settings make new content), or, for an engine that encodes images
itself, as its bytes, named by the content id an upstream keys its cache by. `answer_parts` is
the way back: an answer as it is stored in the conversation.

Namespaces: KV is kept per (owner, session) (`kv_key_for`), so a session id reused by another
API key never meets it; prefix caching is shared within an API key, narrowed by a client's
`cache_salt` (`cache_salt_for`).
"""

from __future__ import annotations

import functools
import hashlib
from typing import TYPE_CHECKING

from encoder_worker.storage import scoped_digest
from gateway.chat.image_input import media_type
from gateway.chat.tool_stream import ToolCall, render_answer, render_tool_result, split_answer
from gateway.engine.interface import ImageInput, Message, SamplingParams
from gateway.sessions.session import StoredPart

if TYPE_CHECKING:
    from encoder_worker.types import EncodedImage
    from gateway.chat.events import ResponseOptions
    from gateway.chat.vision_resolver import Resolved, VisionResolver
    from gateway.sessions.session import Session

__all__ = (
    "answer_parts",
    "cache_salt_for",
    "kv_key_for",
    "sampling_for",
    "token_image",
    "turn_messages",
)


def kv_key_for(owner: str, session_id: str) -> str:
    """The engine's KV namespace for a session: owner and id together, hashed."""
    return hashlib.sha256(f"{owner}\0{session_id}".encode()).hexdigest()[:32]


def cache_salt_for(owner: str, salt: str | None) -> str:
    """The prefix-cache namespace of a request: its API key's, narrowed by a client's salt."""
    return owner if salt is None else f"{owner}\0salt:{salt}"


def sampling_for(session: Session, options: ResponseOptions, limit: int) -> SamplingParams:
    """The response's sampling values: its own where given, else its session's; the answer's
    length capped at the gateway's `limit`."""
    return SamplingParams(
        max_output_tokens=min(options.max_output_tokens or session.max_output_tokens, limit),
        temperature=session.temperature if options.temperature is None else options.temperature,
        top_p=session.top_p if options.top_p is None else options.top_p,
        seed=session.seed if options.seed is None else options.seed,
        stop=options.stop,
        logprobs=options.logprobs,
        n=options.n,
        grammar=options.grammar,
    )


def token_image(fingerprint: str, digest: str, encoded: EncodedImage) -> ImageInput:
    """An image as visual tokens (host tensors: the engine moves each chunk it runs to its own
    device and dtype), decoded from their stored form only when the engine reads them (an
    upstream replica's part rendered on an earlier turn needs none). The id names the tokens,
    not just the bytes: a new encoder config is new content."""
    return ImageInput(
        f"{fingerprint[:16]}:{digest}",
        layout=encoded.layout,
        decode=functools.partial(encoded.embeds, "cpu"),
        rows=encoded.tokens_kept,
        hidden=encoded.hidden_size,
    )


def turn_messages(
    vision: VisionResolver,
    session: Session,
    options: ResponseOptions,
    images: dict[str, Resolved],
    originals: dict[str, bytes] | None = None,
) -> list[Message]:
    """The conversation as the engine's messages, images as `images` (tokens by digest) or
    `originals` (bytes by digest) hold them; an answer still being written is left out."""
    instructions = session.instructions if options.instructions is None else options.instructions
    if options.tools_prompt:
        instructions = (
            f"{instructions}\n\n{options.tools_prompt}" if instructions else options.tools_prompt
        )
    messages: list[Message] = []
    if instructions:
        messages.append(Message("system", [instructions]))
    by_digest: dict[str, ImageInput] = {}
    for item in session.items:
        if item.status == "in_progress":  # another response's answer, still being written
            continue
        if item.role == "tool":  # a tool's result: the model reads it as the user's turn
            result = "".join(part.text or "" for part in item.parts)
            messages.append(Message("user", [render_tool_result(result)]))
            continue
        content: list[str | ImageInput] = []
        calls: list[ToolCall] = []
        for part in item.parts:
            if part.kind == "text":
                content.append(part.text or "")
            elif part.kind == "tool_call":
                calls.append(ToolCall(part.call_id or "", part.name or "", part.text or ""))
            elif part.digest is not None and (
                (originals and part.digest in originals) or part.digest in images
            ):
                image = by_digest.get(part.digest)
                if image is None:
                    image = _image(vision, session.owner, part.digest, images, originals)
                    by_digest[part.digest] = image
                content.append(image)
        if calls:  # the calls as the model wrote them, after the text
            text = "".join(p for p in content if isinstance(p, str))
            content = [render_answer(text, calls)]
        if content:
            messages.append(Message(item.role, content))
    return messages


def _image(
    vision: VisionResolver,
    owner: str,
    digest: str,
    images: dict[str, Resolved],
    originals: dict[str, bytes] | None,
) -> ImageInput:
    if originals and digest in originals:
        data = originals[digest]
        # the content id an upstream keys its multimodal cache by: the digest, or a per-key
        # name when images are not shared across API keys
        content_id = digest if vision.share_across_keys else scoped_digest(owner, digest)
        return ImageInput(content_id, None, data=data, mime=media_type(data))
    return token_image(vision.fingerprint, digest, images[digest].image)


def answer_parts(text: str, options: ResponseOptions) -> list[StoredPart]:
    """An answer as stored: its text, and with tools its calls as `tool_call` parts (the text
    part only when there is text or there are no calls, as a replayed message parses)."""
    if not options.tools:
        return [StoredPart("text", text=text)]
    rest, calls = split_answer(text, options.response_id)
    parts = [StoredPart("text", text=rest)] if rest or not calls else []
    parts += [StoredPart("tool_call", text=c.arguments, name=c.name, call_id=c.id) for c in calls]
    return parts
