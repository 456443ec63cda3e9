"""`prompt_cache_options.prewarm` (and, over WebSocket, `generate: false`): a response that
prepares the prompt cache for the next one and generates nothing.

The input items join the conversation as any response's do (a new chain, or appended to the
previous response's session), and the response's record names the last of them, so the next
response continues from it with `previous_response_id`. Then every image of the conversation
is encoded (or found in the vision cache) and the conversation through its last item is
prefilled into the engine's prefix cache by the session's KV warm-up
(`gateway.chat.session_warmup`), rendered with this response's instructions and tools: lowest
priority, its blocks pinned for the session until its next response, dropped first under KV
pressure. The next response's prompt (with the same instructions and tools) starts with that
prefix, so it prefills only its own input.

The response has no output; its status is completed once the warm-up ended (warmed, or dropped
for other work: the prewarm is then only a stored turn, and its notes say why). Its usage counts
the prompt positions the cache holds for the session as `input_tokens`, those this prewarm
computed as `cache_write_tokens` and the rest (already cached) as `cached_tokens`, with no output
tokens; the key's token limits count them as input. Over upstream replicas sent visual tokens
(embeds mode) the warm-up is the upstream engine's. What is refused here (`check_prewarm`): an
engine that cannot warm up (an upstream engine in data-URL mode), `store: false` (nothing would
be kept), and prompt-cache diagnostics (`comparison_response_id`). `ttl`, `mode`,
`prompt_cache_key` and explicit breakpoints are accepted and said in the response's notes
(`cache_notes`): the engine caches every full KV block of every prompt by content, so
breakpoints add nothing, and warmed blocks stay pinned until the session's next response, KV
pressure or the session's expiry.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import structlog

from gateway.api.openai.chat import protocol as p
from gateway.api.openai.responses import protocol as r
from gateway.chat.metering import input_estimate
from gateway.chat.requests import check_cache_salt
from gateway.chat.session_warmup import warm_up
from gateway.policy.key_usage import TokenUsage
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.api.openai.responses.output_builder import PreparedResponse
    from gateway.chat.service import ChatService
    from gateway.chat.vision_resolver import Resolved
    from gateway.engine.interface import Engine, WarmUpResult
    from gateway.settings import Settings

__all__ = ("cache_notes", "check_prewarm", "prewarm", "prewarm_response", "wants_prewarm")

log = structlog.get_logger("visiongate.http")

PARAM = "prompt_cache_options.prewarm"
TTL_S = {"30m": 30 * 60, "12h": 12 * 3600}


def wants_prewarm(request: r.ResponsesRequest) -> bool:
    options = request.prompt_cache_options
    return bool(options is not None and options.prewarm)


def check_prewarm(request: r.ResponsesRequest, engine: Engine) -> None:
    """Refuse what a prewarm cannot do, before anything is stored (`GatewayError`, 400)."""
    options = request.prompt_cache_options
    if options is not None and options.comparison_response_id is not None:
        raise GatewayError(
            "invalid_request",
            "prompt cache diagnostics are not supported",
            param="prompt_cache_options.comparison_response_id",
        )
    check_cache_salt(request.prompt_cache_key, "prompt_cache_key")
    if not wants_prewarm(request):
        return
    if not engine.capabilities.warm_up or engine.capabilities.image_input == "bytes":
        raise GatewayError(
            "invalid_request",
            "prewarm needs an engine whose prompt cache the gateway can warm up; the served "
            "engine has none (an upstream engine warms up in embeds mode only)",
            param=PARAM,
        )
    if request.store is False:
        raise GatewayError(
            "invalid_request",
            "a prewarm is kept for the conversation's next response: it needs store (true)",
            param="store",
        )


def cache_notes(request: r.ResponsesRequest, settings: Settings) -> list[str]:
    """What the prompt-cache parameters do here, in words, for the response's notes."""
    options = request.prompt_cache_options
    notes: list[str] = []
    if options is not None and options.ttl is not None:
        bound = min(TTL_S[options.ttl], settings.session_ttl_s)
        notes.append(
            f"prompt_cache_options.ttl {options.ttl}: warmed KV blocks stay pinned until the "
            f"conversation's next response, KV pressure, or at most {bound} s "
            "(the session's lifetime)"
        )
    if options is not None and options.mode == "explicit":
        notes.append(
            "prompt_cache_options.mode explicit: every full KV block of every prompt is cached "
            "by content; breakpoints are not needed and are ignored"
        )
    if request.prompt_cache_key is not None:
        notes.append(
            "prompt_cache_key: every request of this API key shares one prefix cache already"
        )
    return notes


async def prewarm(
    service: ChatService, prepared: PreparedResponse, owner: str
) -> tuple[WarmUpResult | None, dict[str, Resolved], float]:
    """Encode the conversation's images and warm its KV (see the module doc): the warm-up's
    result (None: the engine rendered nothing to warm), the resolved images, and the encode
    wait in ms. Raises `GatewayError` for an image that cannot be encoded or a key's token
    limits that refuse it."""
    session = prepared.session
    meter = service.meter.open(owner) if service.meter is not None else None
    try:
        if meter is not None:
            refusal = await meter.admit(
                input_estimate(session, prepared.options, service.image_tokens_estimate), 0
            )
            if refusal is not None:
                raise refusal
        t0 = time.perf_counter()
        tasks = {
            digest: asyncio.ensure_future(service.vision.resolve(owner, digest))
            for digest in session.image_digests
        }
        try:
            await asyncio.gather(*tasks.values())
        except BaseException:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            raise
        encode_ms = (time.perf_counter() - t0) * 1000
        images = {digest: task.result() for digest, task in tasks.items()}
        result = await warm_up(
            service.engine,
            service.vision,
            service.telemetry,
            service.max_output_tokens_limit,
            session,
            pending=tasks,
            options=prepared.options,  # its instructions and tools, as the next one's
        )
        if meter is not None:
            positions = result.positions if result is not None else 0
            computed = result.computed if result is not None else 0
            meter.finish(
                TokenUsage(
                    input_tokens=positions,
                    cached_tokens=positions - computed,
                    image_tokens=sum(i.image.tokens_kept for i in images.values()),
                    encode_ms=encode_ms,
                )
            )
        return result, images, encode_ms
    finally:
        if meter is not None:
            meter.close()


def prewarm_response(
    response: r.ResponseObject,
    prepared: PreparedResponse,
    result: WarmUpResult | None,
    images: dict[str, Resolved],
    encode_ms: float,
    total_ms: float,
) -> r.ResponseObject:
    """`response` (a snapshot) as a finished prewarm: completed, no output, its usage, and
    notes that say what was warmed."""
    positions = result.positions if result is not None else 0
    computed = result.computed if result is not None else 0
    response.status = "completed"
    response.output = []
    response.usage = r.ResponseUsage(
        input_tokens=positions,
        input_tokens_details=r.InputTokensDetails(
            cached_tokens=positions - computed, cache_write_tokens=computed
        ),
        output_tokens=0,
        output_tokens_details=r.OutputTokensDetails(),
        total_tokens=positions,
    )
    if result is None:
        said = "prewarm: nothing was warmed (no prompt to prefill); no output was generated"
    elif result.outcome in ("warmed", "superseded"):
        said = (
            f"prewarm: {positions} prompt positions are in the prompt cache for this "
            f"conversation ({computed} prefilled now); no output was generated"
        )
    else:
        said = (
            f"prewarm {result.outcome}: {result.reason or 'no reason given'}; the input is "
            "stored and the next response prefills it; no output was generated"
        )
    hits = sum(1 for i in images.values() if i.source in ("memory", "redis"))
    vision = "none" if not images else "miss" if not hits else "partial"
    if images and hits == len(images):
        vision = "hit"
    response.visiongate = r.ResponseExtension(
        timings=p.Timings(
            queue_ms=result.queue_ms if result is not None else 0.0,
            encode_ms=encode_ms,
            prefill_ms=result.prefill_ms if result is not None else 0.0,
            total_ms=total_ms,
        ),
        cache=p.CacheReport(
            vision=vision,  # type: ignore[arg-type]
            vision_hits=hits,
            vision_misses=len(images) - hits,
            kv_tokens_reused=positions - computed,
        ),
        image_tokens=sum(i.image.tokens_kept for i in images.values()),
        session_id=prepared.session.id,
        stored=True,
        forked=prepared.forked,
        notes=[said, *prepared.notes],
    )
    log.info(
        "responses_prewarm",
        response_id=response.id,
        session_id=prepared.session.id,
        outcome=result.outcome if result is not None else None,
        positions=positions,
        computed=computed,
    )
    return response
