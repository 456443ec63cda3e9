"""Span vocabulary of one response and the helpers that cross thread and process boundaries.

A response is one root span ``chat <model>`` (GenAI naming) with children per stage. Encoder
work happens in a worker thread or another process, so its context travels explicitly as a
W3C ``traceparent`` string inside the job, and stage timings measured there become spans
afterwards with explicit start and end times (`record_stage_spans`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from encoder_worker.spans import ENCODE_ATTR, ENCODE_SPAN, STAGE_PREFIX

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.util.types import AttributeValue

__all__ = (
    "ATTR",
    "SPAN",
    "context_from_traceparent",
    "record_stage_spans",
    "response_span_name",
    "traceparent",
)


class SPAN:
    """Span names of one response, in the order they usually start. The encode stages are the
    encoder worker's names (`encoder_worker.spans`), so both sides of a job trace alike."""

    SESSION_LOAD = "session.load"
    IMAGE_RESOLVE = "image.resolve"
    # an encode started when its image arrived, before any response asked for it: the root of
    # a trace of its own, linked from the `image.resolve` of the response that uses the tokens
    IMAGE_PREENCODE = "image.preencode"
    ENCODE_QUEUE = ENCODE_SPAN.QUEUE
    ENCODE_PREPROCESS = ENCODE_SPAN.PREPROCESS
    ENCODE_VISION = ENCODE_SPAN.VISION
    ENCODE_PRUNE = ENCODE_SPAN.PRUNE
    ENCODE_QUANTIZE = ENCODE_SPAN.QUANTIZE
    CACHE_PUT = ENCODE_SPAN.CACHE_PUT
    LLM_PREFILL = "llm.prefill"
    LLM_DECODE = "llm.decode"
    STREAM = "stream"
    EVENT_TTFT = "ttft"


class ATTR:
    """Span attribute keys: GenAI semantic conventions where they exist, ``visiongate.*`` else."""

    OPERATION = "gen_ai.operation.name"
    PROVIDER = "gen_ai.provider.name"
    REQUEST_MODEL = "gen_ai.request.model"
    RESPONSE_ID = "gen_ai.response.id"
    SESSION_ID = "gen_ai.conversation.id"  # a visiongate session is a GenAI conversation
    INPUT_TOKENS = "gen_ai.usage.input_tokens"
    OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    FINISH_REASONS = "gen_ai.response.finish_reasons"
    ERROR_TYPE = "error.type"
    API = "visiongate.api"
    CACHE_TIER = "visiongate.cache.tier"
    CACHE_HIT = "visiongate.cache.hit"
    IMAGE_DIGEST = ENCODE_ATTR.IMAGE_DIGEST
    ITEM_ID = "visiongate.item.id"  # the conversation item an image came in
    PREFILL_TOKENS = "visiongate.llm.prefill_tokens"
    REUSED_KV_TOKENS = "visiongate.llm.reused_kv_tokens"
    DECODE_TOKENS = "visiongate.llm.decode_tokens"
    PREFILL_CHUNKS = "visiongate.prefill.chunks"  # scheduler steps the prefill was split over
    PREEMPTIONS = "visiongate.preemptions"  # times the request lost its KV and was recomputed
    ITL_P95_MS = "visiongate.llm.itl_p95_ms"  # P95 gap between the response's text deltas
    BATCH_SIZE = ENCODE_ATTR.BATCH_SIZE
    TOKENS_KEPT = ENCODE_ATTR.TOKENS_KEPT
    TOKENS_TOTAL = ENCODE_ATTR.TOKENS_TOTAL
    TTFT_MS = "visiongate.ttft_ms"


def response_span_name(model: str) -> str:
    """GenAI span name for one chat response: ``"{operation} {model}"``."""
    return f"chat {model}"


_PROPAGATOR = TraceContextTextMapPropagator()


def _as_context(parent: Context | Span | None) -> Context | None:
    if parent is None or isinstance(parent, Context):
        return parent
    return trace.set_span_in_context(parent)


def traceparent(parent: Context | Span | None = None) -> str | None:
    """The W3C ``traceparent`` of ``parent`` (or of the current span) for an encode job, or
    ``None`` when there is no valid span to continue."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=_as_context(parent))
    return carrier.get("traceparent")


def context_from_traceparent(value: str | None, tracestate: str | None = None) -> Context:
    """A context whose parent is the remote span named by ``value``; an empty context when
    ``value`` is missing or malformed (the worker then starts its own trace)."""
    carrier: Mapping[str, str] = {}
    if value:
        carrier = {"traceparent": value, **({"tracestate": tracestate} if tracestate else {})}
    return _PROPAGATOR.extract(carrier, context=Context())


def record_stage_spans(
    tracer: Tracer,
    parent: Context | Span | None,
    start_ns: int,
    timings_ms: Mapping[str, float],
    prefix: str = STAGE_PREFIX,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> int:
    """Record already-finished spans, one per ``timings_ms`` entry in its order, laid end to
    end from ``start_ns`` (epoch ns). A key already carrying ``prefix`` is not prefixed again.
    Returns the end time of the last span, so callers can continue the timeline."""
    context = _as_context(parent)
    attrs: dict[str, Any] = dict(attributes or {})
    cursor = int(start_ns)
    for stage, ms in timings_ms.items():
        name = stage if stage.startswith(prefix) else prefix + stage
        end = cursor + max(round(float(ms) * 1_000_000), 0)
        span = tracer.start_span(name, context=context, start_time=cursor, attributes=attrs)
        span.end(end_time=end)
        cursor = end
    return cursor
