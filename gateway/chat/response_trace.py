"""One response's trace and metrics, recorded from the timings the service measures.

The service's work is an async generator and its encoder and engine run on worker threads, so
spans are not made current across awaits: the root span `chat <model>` is started explicitly,
and each stage becomes a child span with explicit start and end times once its duration is
known. With `NoopTelemetry` it records nothing.

`llm.prefill` carries how the scheduler ran the prompt (`visiongate.prefill.chunks`,
`visiongate.preemptions`); the root span carries the response's P95 inter-token latency, and
each gap between its text deltas is one observation of the inter-token latency histogram.
The root span also names the request it answers (`visiongate.request_id`, the response's
`x-request-id`), read from the context the trace is made in.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from encoder_worker.types import ENCODE_STAGES
from gateway.telemetry import ATTR, SPAN, Telemetry, log_response, response_span_name, traceparent
from gateway.telemetry.request_ids import current_request_id

if TYPE_CHECKING:
    from gateway.chat.events import Finished
    from gateway.chat.vision_resolver import Resolved
    from gateway.engine.interface import GenerationResult

__all__ = ("ResponseTrace",)

STAGES = ("queue", *ENCODE_STAGES)
# the HTTP request (or WebSocket connection) the response answers: its `x-request-id`
REQUEST_ID_ATTR = "visiongate.request_id"


def _ns(ms: float) -> int:
    return max(int(ms * 1_000_000), 0)


def _p95(values: tuple[float, ...]) -> float:
    """Nearest-rank P95 (an observed value, no interpolation) of a non-empty sample."""
    ordered = sorted(values)
    return ordered[max(math.ceil(0.95 * len(ordered)) - 1, 0)]


class ResponseTrace:
    __slots__ = (
        "api",
        "context",
        "itl_ms",
        "model",
        "response_id",
        "root",
        "session_id",
        "started_ns",
        "telemetry",
        "tracer",
    )

    def __init__(
        self,
        telemetry: Telemetry,
        *,
        model: str,
        api: str,
        response_id: str,
        session_id: str | None,
        started_ns: int | None = None,
    ) -> None:
        self.telemetry = telemetry
        self.tracer = telemetry.tracer
        self.api, self.model, self.session_id, self.response_id = (
            api,
            model,
            session_id,
            response_id,
        )
        self.started_ns = started_ns or time.time_ns()
        self.itl_ms: tuple[float, ...] = ()  # the engine's gaps between text deltas, once known
        attributes = {
            ATTR.OPERATION: "chat",
            ATTR.PROVIDER: "visiongate",
            ATTR.REQUEST_MODEL: model,
            ATTR.RESPONSE_ID: response_id,
            ATTR.API: api,
        }
        if session_id:
            attributes[ATTR.SESSION_ID] = session_id
        if request_id := current_request_id():
            attributes[REQUEST_ID_ATTR] = request_id
        self.root = self.tracer.start_span(
            response_span_name(model),
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=self.started_ns,
        )
        self.context = trace.set_span_in_context(self.root)

    def span(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        attributes: dict[str, Any] | None = None,
        parent: Any = None,
    ) -> Any:
        span = self.tracer.start_span(
            name, context=parent or self.context, start_time=start_ns, attributes=attributes or {}
        )
        span.end(end_time=max(end_ns, start_ns))
        return span

    def start_image(self, digest: str) -> tuple[Any, str | None]:
        """Open `image.resolve` now; its W3C traceparent goes with an encode job to a worker,
        whose spans then join this trace."""
        span = self.tracer.start_span(
            SPAN.IMAGE_RESOLVE, context=self.context, attributes={ATTR.IMAGE_DIGEST: digest[:12]}
        )
        return span, traceparent(span)

    def image(self, parent: Any, resolved: Resolved) -> None:
        """Close `image.resolve`, linked to the pre-encode that made the tokens if one did
        (its own trace: a remote worker's spans are beneath it); for an encode done in this
        process, record its stage spans and `cache.put` beneath `image.resolve` (a remote
        worker records its own)."""
        hit = resolved.source in ("memory", "redis")
        if resolved.preencode is not None:
            parent.add_link(resolved.preencode)
        parent.set_attributes(
            {
                ATTR.CACHE_HIT: hit,
                ATTR.CACHE_TIER: resolved.source if hit else "none",
                ATTR.TOKENS_KEPT: resolved.image.tokens_kept,
                ATTR.TOKENS_TOTAL: resolved.image.tokens_total,
            }
        )
        parent.end()
        if hit or resolved.encode_started_ns is None:
            return
        timings = resolved.image.timings_ms
        stages = {f"encode.{k}": timings[k] for k in STAGES if k in timings}
        ctx = trace.set_span_in_context(parent)
        cursor = self.telemetry.stage_spans(
            ctx,
            resolved.encode_started_ns,
            stages,
            attributes={ATTR.BATCH_SIZE: int(timings.get("batch_size", 1))},
        )
        self.span(SPAN.CACHE_PUT, cursor, cursor + _ns(resolved.put_ms), parent=ctx)

    def image_failed(self, parent: Any, exc: BaseException) -> None:
        parent.set_status(Status(StatusCode.ERROR, str(exc)))
        parent.set_attribute("error.type", getattr(exc, "code", type(exc).__name__))
        parent.end()

    def llm(self, generate_ns: int, result: GenerationResult) -> None:
        prefill_start = generate_ns + _ns(result.queue_ms)
        prefill_end = prefill_start + _ns(result.prefill_ms)
        self.span(
            SPAN.LLM_PREFILL,
            prefill_start,
            prefill_end,
            {
                ATTR.PREFILL_TOKENS: result.input_tokens - result.cached_tokens,
                ATTR.REUSED_KV_TOKENS: result.cached_tokens,
                ATTR.PREFILL_CHUNKS: result.prefill_chunks,
                ATTR.PREEMPTIONS: result.preemptions,
            },
        )
        self.span(
            SPAN.LLM_DECODE,
            prefill_end,
            prefill_end + _ns(result.decode_ms),
            {ATTR.DECODE_TOKENS: result.output_tokens},
        )
        self.itl_ms = tuple(result.itl_ms)
        if self.itl_ms:
            self.root.set_attribute(ATTR.ITL_P95_MS, round(_p95(self.itl_ms), 3))

    def first_token(self, ttft_ms: float) -> None:
        self.root.add_event(SPAN.EVENT_TTFT, {ATTR.TTFT_MS: ttft_ms})

    def finish(
        self, done: Finished, *, stream_start_ns: int | None = None, end_ns: int | None = None
    ) -> None:
        """Close the root span, write the access line and record the response's metrics
        (`end_ns`: when the response ended, now if None)."""
        end_ns = time.time_ns() if end_ns is None else end_ns
        if stream_start_ns is not None:
            self.span(
                SPAN.STREAM, stream_start_ns, end_ns, {ATTR.OUTPUT_TOKENS: done.output_tokens}
            )
        self.root.set_attribute(ATTR.INPUT_TOKENS, done.input_tokens)
        self.root.set_attribute(ATTR.OUTPUT_TOKENS, done.output_tokens)
        self.root.set_attribute(ATTR.FINISH_REASONS, [done.status])
        if done.error is not None:
            self.root.set_attribute(ATTR.ERROR_TYPE, done.error.code)
            self.root.set_status(Status(StatusCode.ERROR, done.error.message))
        with trace.use_span(self.root, end_on_exit=False):
            log_response(
                api=self.api,
                model=self.model,
                status=done.status,
                session_id=self.session_id,
                response_id=self.response_id,
                timings_ms=done.timings,
                usage={
                    "input_tokens": done.input_tokens,
                    "output_tokens": done.output_tokens,
                    "image_tokens": done.image_tokens,
                    "cached_tokens": done.cached_tokens,
                },
                vision_cache=done.vision,
            )
        metrics = self.telemetry.metrics
        decode_s = done.timings.get("decode_ms", 0.0) / 1e3
        metrics.record_response(
            model=self.model,
            status=done.status,
            ttft_s=done.timings["ttft_ms"] / 1e3 if done.timings.get("ttft_ms") else None,
            duration_s=done.timings.get("total_ms", 0.0) / 1e3,
            output_tokens=done.output_tokens,
            input_tokens=done.input_tokens,
            image_tokens=done.image_tokens,
            cached_tokens=done.cached_tokens,
            time_per_output_token_s=decode_s / max(done.output_tokens - 1, 1)
            if done.output_tokens > 0 and decode_s > 0
            else None,
            api=self.api,
            inter_token_latencies_s=[ms / 1e3 for ms in self.itl_ms],
        )
        if done.input_tokens:
            metrics.record_kv_reuse(
                reused_tokens=done.cached_tokens,
                prefill_tokens=done.input_tokens - done.cached_tokens,
            )
            metrics.record_cache_lookup(
                cache="kv", tier="memory", result="hit" if done.cached_tokens else "miss"
            )
        self.root.end(end_time=end_ns)
