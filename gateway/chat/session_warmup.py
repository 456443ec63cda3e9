"""A session's KV warmed up before its next turn: its conversation prefilled into the engine.

A warm-up renders the conversation exactly as the next response will (`turn_prompt`,
`context_fit`), so the prefix it leaves in the engine's cache is the one that response finds.
It never waits for an encode and never refuses: without every image's tokens ready, or with an
engine that cannot warm up, it does nothing (None). Each warm-up is traced as `llm.warmup`,
counted and logged.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import structlog

from gateway.chat.context_fit import fit_messages
from gateway.chat.events import ResponseOptions
from gateway.chat.turn_prompt import kv_key_for, token_image, turn_messages
from gateway.chat.vision_resolver import Resolved
from gateway.engine.interface import GenerationRequest, Message, SamplingParams
from gateway.protocol.errors import GatewayError
from gateway.sessions.session import new_id
from gateway.telemetry import ATTR

if TYPE_CHECKING:
    from gateway.chat.vision_resolver import VisionResolver
    from gateway.engine.interface import Engine, WarmUpResult
    from gateway.sessions.session import Session
    from gateway.telemetry import Telemetry

__all__ = ("warm_up",)

log = structlog.get_logger("visiongate.service")


async def warm_up(
    engine: Engine,
    vision: VisionResolver,
    telemetry: Telemetry,
    max_output_tokens_limit: int,
    session: Session,
    *,
    pending: dict[str, asyncio.Task[Resolved]] | None = None,
    then_image: str | None = None,
    options: ResponseOptions | None = None,
) -> WarmUpResult | None:
    """Prefill the session's conversation as its next response will render it, through its
    last item (a finished message: the question comes as an item of its own), or with
    `then_image` (a digest) as the start of a new user message left open (an HTTP turn
    that sends the photo and its question together), into the engine's prefix cache,
    pinned for the session. Only images whose tokens are ready are used (pre-encodes that
    finished, or the vision cache): None, without touching the engine, while any is still
    encoding or the engine cannot warm up. `options`: the next response's instructions and
    tools prompt, where the caller knows them (a Responses prewarm); the session's otherwise.
    Traced as `llm.warmup` and counted."""

    if not engine.capabilities.warm_up or engine.capabilities.image_input == "bytes":
        return None
    started_ns = time.time_ns()
    digests = [*session.image_digests]
    if then_image is not None and then_image not in digests:
        digests.append(then_image)
    images: dict[str, Resolved] = {}
    for digest in digests:
        task = (pending or {}).get(digest)
        if task is not None and task.done() and not task.cancelled() and not task.exception():
            images[digest] = task.result()
            continue
        if task is not None and not task.done():
            return None  # its item warms the session once it is encoded
        encoded = await vision.cached(session.owner, digest)
        if encoded is None:
            return None
        images[digest] = Resolved(encoded, "memory", 0.0)
    messages = turn_messages(vision, session, options or ResponseOptions(), images)
    if then_image is not None:
        # as `turn_messages` names and places it in the turn that will send it
        image = token_image(vision.fingerprint, then_image, images[then_image].image)
        messages.append(Message("user", [image]))
    if not messages:
        return None
    max_tokens = min(session.max_output_tokens, max_output_tokens_limit)
    try:
        messages, _ = await fit_messages(engine, messages, max_tokens, session.truncation)
    except GatewayError:
        return None
    request = GenerationRequest(
        request_id=new_id("warm"),
        messages=messages,
        sampling=SamplingParams(max_output_tokens=1),
        kv_key=kv_key_for(session.owner, session.id),
        cache_salt=session.owner,
        owner=session.owner,
        warm_up="part" if then_image is not None else "message",
    )
    result: WarmUpResult = await engine.warm_up(request)
    span = telemetry.tracer.start_span(
        "llm.warmup",
        start_time=started_ns,
        attributes={
            ATTR.SESSION_ID: session.id,
            "visiongate.warmup.outcome": result.outcome,
            "visiongate.warmup.positions": result.positions,
            ATTR.PREFILL_TOKENS: result.computed,
            "visiongate.warmup.queue_ms": result.queue_ms,
            "visiongate.warmup.prefill_ms": result.prefill_ms,
        },
    )
    if result.reason:
        span.set_attribute("visiongate.warmup.reason", result.reason)
    span.end()
    telemetry.metrics.record_kv_warmup(outcome=result.outcome, computed_tokens=result.computed)
    log.info(
        "kv_warmup",
        session_id=session.id,
        outcome=result.outcome,
        positions=result.positions,
        computed=result.computed,
        reason=result.reason or None,
    )
    return result
