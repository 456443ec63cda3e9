"""Fitting a turn's prompt to the model's context, with room for the answer.

`fit_messages` returns the messages that fit and how many conversation messages it left out.
Token counts are upper bounds (the chat template's overhead per message and per image
included); most turns fit by a byte count alone and are never tokenized here. When they must
be, one worker thread counts for every response (a tokenizer is not shared across threads),
off the event loop. The instructions and the latest message always stay; a turn left out is
left out whole, so the kept conversation never starts with an assistant message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Literal

import structlog

from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.engine.interface import Engine, Message

__all__ = ("IMAGE_OVERHEAD_TOKENS", "MESSAGE_OVERHEAD_TOKENS", "fit_messages")

log = structlog.get_logger("visiongate.service")

# conservative per-part costs of the chat template around the content, in tokens: role markers
# and separators per message; image wrappers (and a VLM's tile and row markers) per image
MESSAGE_OVERHEAD_TOKENS = 8
IMAGE_OVERHEAD_TOKENS = 32

# one thread counts tokens for every response: a tokenizer is not shared across threads
_counting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="count-tokens")


async def fit_messages(
    engine: Engine,
    messages: list[Message],
    max_output_tokens: int,
    truncation: Literal["auto", "disabled"],
) -> tuple[list[Message], int]:
    """The messages that fit the model's context with room for the answer, and how many
    conversation messages were left out. "auto" leaves out the oldest turns (the
    instructions and the latest message always stay); "disabled" refuses instead
    (`context_length_exceeded`)."""
    context = engine.context_tokens
    room = context - min(max_output_tokens, context // 4)
    # an image sent as bytes has no tokens here yet: the engine's estimate of what it
    # becomes upstream (0 when it gives none)
    per_image = engine.capabilities.image_tokens_estimate

    def cost(message: Message, count: Callable[[str], int]) -> int:
        n = MESSAGE_OVERHEAD_TOKENS
        for part in message.content:
            if isinstance(part, str):
                n += count(part) if part else 0
            else:
                tokens = part.num_tokens if part.has_embeds else per_image
                n += tokens + IMAGE_OVERHEAD_TOKENS
        return n

    # a byte-level tokenizer never makes more tokens than the text has UTF-8 bytes: most
    # turns fit by that bound alone and are never tokenized here
    if sum(cost(m, lambda text: len(text.encode())) for m in messages) <= room:
        return messages, 0
    loop = asyncio.get_running_loop()
    costs = await loop.run_in_executor(
        _counting, lambda: [cost(m, engine.count_tokens) for m in messages]
    )
    total = sum(costs)
    if total <= room:
        return messages, 0
    head = 1 if messages and messages[0].role == "system" else 0
    if truncation == "disabled" or len(messages) - head <= 1:
        raise GatewayError(
            "context_length_exceeded",
            f"the conversation needs about {total} tokens and "
            f"the model takes {context}, {context - room} of them kept for the answer; "
            + (
                'delete older items or set truncation to "auto"'
                if truncation == "disabled"
                else "shorten the latest message"
            ),
            param="messages",
        )
    # drop whole turns from the oldest on; a turn never starts with an assistant message
    start = head
    while start < len(messages) - 1 and (total > room or messages[start].role == "assistant"):
        total -= costs[start]
        start += 1
    if total > room:
        raise GatewayError(
            "context_length_exceeded",
            f"the latest message needs about "
            f"{total} tokens; the model takes {context}, {context - room} of "
            "them kept for the answer",
            param="messages",
        )
    kept = messages[:head] + messages[start:]
    log.info("context_truncated", dropped=start - head, kept_tokens=total, context=context)
    return kept, start - head
