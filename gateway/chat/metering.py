"""The chat layer's side of per key token limits and usage (`gateway.policy.key_usage`).

`ChatService` opens a meter for each response of a key under limits, admits it with
`input_estimate` / `raw_input_estimate` and the output it may write (`output_reservation` /
`raw_output_reservation`: what the engine will be told is the most it may write, for every
answer) before the answer takes its place in the conversation (`admitted`: a refused response
leaves nothing stored), hands each of its events to `count` (`observe`; at the end, the wait
until what the response gives back is written, so that the client's next request, on any
replica, finds its room) as it reads them, and closes the meter once they are over (closing
twice gives nothing back twice). The estimates
are cheap (no tokenizer, `text_tokens_estimate`: characters / 3, but never fewer than the
text's words plus its digits, and a token for every byte past the first of a character beyond
ASCII; then a per message and per image allowance) and err high for the text of a byte-level
tokenizer, dense text too (one-letter words, digits, symbols: an estimate below the real count
would let concurrent responses past the limit); the real counts replace them when the
response ends.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import structlog

from gateway.chat.context_fit import IMAGE_OVERHEAD_TOKENS, MESSAGE_OVERHEAD_TOKENS
from gateway.chat.events import Finished, TextChunk
from gateway.chat.generation_stream import ms_since
from gateway.chat.turn_prompt import sampling_for
from gateway.engine.interface import CHARS_PER_TOKEN
from gateway.policy.key_usage import TokenUsage

if TYPE_CHECKING:
    from gateway.chat.events import ResponseOptions
    from gateway.chat.generation_stream import Ending
    from gateway.engine.interface import Engine
    from gateway.policy.key_usage import Metered, TokenMeter
    from gateway.sessions.session import Session

__all__ = (
    "IMAGE_TOKENS_ESTIMATE",
    "admitted",
    "count",
    "image_tokens_estimate",
    "input_estimate",
    "observe",
    "output_reservation",
    "raw_input_estimate",
    "raw_output_reservation",
    "text_tokens_estimate",
)

log = structlog.get_logger("visiongate.metering")
# visual tokens counted for an image before it is resolved when neither the engine nor the
# encoder's config says more (`image_tokens_estimate`)
IMAGE_TOKENS_ESTIMATE = 256


_DIGITS = "0123456789"


def text_tokens_estimate(text: str) -> int:
    """The tokens of `text`, estimated without a tokenizer, erring high: characters / 3, or
    its whitespace-separated words plus its digits where that is more (every word is a token at
    least, and many tokenizers split digits), plus the UTF-8 bytes past the first of each
    non-ASCII character (a byte-level tokenizer may need one token a byte)."""
    if not text:
        return 0
    dense = len(text.split()) + sum(map(text.count, _DIGITS))
    wide = len(text.encode("utf-8", "surrogatepass")) - len(text)
    return max(math.ceil(len(text) / CHARS_PER_TOKEN), dense) + wide


def image_tokens_estimate(engine: Engine, encoder: object) -> int:
    """What an image not encoded yet counts as: the engine's own figure (an upstream engine
    sent image bytes), else the most tokens the encoder's config makes of one image (a VLM
    checkpoint's bound, a tower's patches), else `IMAGE_TOKENS_ESTIMATE`. Read once, at start."""
    own = engine.capabilities.image_tokens_estimate
    if own:
        return own
    config = getattr(encoder, "config", None)
    if config is None or not hasattr(type(config), "max_image_tokens"):
        return IMAGE_TOKENS_ESTIMATE
    try:
        return int(config.max_image_tokens) or IMAGE_TOKENS_ESTIMATE
    except Exception as exc:  # files unreadable or odd here: never a failed start
        log.warning("image_tokens_estimate.default", error=f"{type(exc).__name__}: {exc}"[:300])
        return IMAGE_TOKENS_ESTIMATE


def input_estimate(session: Session, options: ResponseOptions, per_image: int) -> int:
    """The prompt tokens of a turn over `session`, estimated before anything is resolved;
    `per_image` is what each of its images counts as (`image_tokens_estimate`)."""
    instructions = options.instructions or session.instructions
    texts = [instructions or "", options.tools_prompt or ""] + [
        part.text or ""
        for item in session.items
        for part in item.parts
        if part.kind in ("text", "tool_call")
    ]
    images = len(session.image_digests)
    return (
        sum(map(text_tokens_estimate, texts))
        + MESSAGE_OVERHEAD_TOKENS * (len(session.items) + 1)
        + (per_image + IMAGE_OVERHEAD_TOKENS) * images
    )


def raw_input_estimate(prompts: list[str | tuple[int, ...]]) -> int:
    """The prompt tokens of raw prompts: token ids as they are, texts by their characters."""
    return sum(len(p) if isinstance(p, tuple) else text_tokens_estimate(p) + 1 for p in prompts)


def output_reservation(session: Session, options: ResponseOptions, limit: int) -> int:
    """The most output tokens a turn over `session` may write: its answers' cap (the
    client's `max_tokens`, else the session's, within the gateway's `limit`: what the engine is
    told, `turn_prompt.sampling_for`) times their number."""
    return sampling_for(session, options, limit).max_output_tokens * max(options.n, 1)


def raw_output_reservation(
    prompts: list[str | tuple[int, ...]], options: ResponseOptions, limit: int
) -> int:
    """The most output tokens raw prompts may get: `n` answers each, every one capped as
    `generation_stream.raw_events` caps it (the client's `max_tokens`, else `limit`)."""
    each = min(options.max_output_tokens or limit, limit)
    return each * max(options.n, 1) * len(prompts)


async def admitted(
    meter: TokenMeter | None,
    owner: str,
    estimate: int,
    options: ResponseOptions,
    t0: float,
    ending: Ending,
    reserve: int = 0,
) -> tuple[Metered | None, Finished | None]:
    """The response's meter (None: a key under no limit), or its end when its key's limits
    refuse it: a failed `Finished` with the `rate_limited` (or `concurrency_limited`) error,
    before anything is stored. `reserve`: the most output tokens it may write."""
    metered = meter.open(owner) if meter is not None else None
    refusal = None
    if metered is not None:
        try:
            refusal = await metered.admit(estimate, reserve)
        except BaseException:  # cancelled on its way back: what it took is given back
            metered.close()
            raise
    if refusal is None:
        return metered, None
    timings = {"total_ms": ms_since(t0)}
    refused = Finished(
        options.response_id, options.item_id, "failed", "", error=refusal, timings=timings
    )
    return None, ending.finish(refused)


async def count(meter: Metered, event: object) -> None:
    """`observe` one event of the response; at its end, wait until what it gives back is
    written, so that it lands before its client hears of the end (and sends its next
    request)."""
    observe(meter, event)
    if isinstance(event, Finished):
        await meter.settled()


def observe(meter: Metered, event: object) -> None:
    """Count a streamed text delta as one output token (the engines send one token a delta;
    the end corrects it), and a response's end as its usage."""
    if isinstance(event, TextChunk):
        meter.streamed(1)
    elif isinstance(event, Finished):
        meter.finish(
            TokenUsage(
                input_tokens=event.input_tokens,
                cached_tokens=event.cached_tokens,
                output_tokens=event.output_tokens,
                image_tokens=event.image_tokens,
                encode_ms=event.timings.get("encode_ms", 0.0),
            )
        )
