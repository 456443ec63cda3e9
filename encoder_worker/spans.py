"""Span and attribute names of an image encode, and the worker's recording of them.

The gateway's span vocabulary (`gateway.telemetry.SPAN` / `ATTR`) takes its encode names from
here, so a trace reads the same whether the image was encoded in the gateway's process or in a
worker. A worker records finished spans afterwards, from the timings the pipeline measured,
with explicit start and end times, under the caller's span named by the job's W3C
`traceparent` (or under a root span of its own when the job has none).

Only the OpenTelemetry API is used: spans go to whatever tracer the caller passes (by default
the process's global tracer provider, a no-op until one is installed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from encoder_worker.types import ENCODE_STAGES

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer
    from opentelemetry.util.types import AttributeValue

__all__ = (
    "ENCODE_ATTR",
    "ENCODE_SPAN",
    "STAGE_PREFIX",
    "has_parent",
    "lay_spans",
    "parent_context",
    "stage_span_name",
)

STAGE_PREFIX = "encode."


def stage_span_name(stage: str) -> str:
    """The span name of one `ENCODE_STAGES` stage (a name already prefixed stays as it is)."""
    return stage if stage.startswith(STAGE_PREFIX) else STAGE_PREFIX + stage


class ENCODE_SPAN:
    """Span names of one encode, in the order they start."""

    JOB = "encode.job"  # a worker's root span, for a job that came without a traceparent
    QUEUE = "encode.queue"
    DECODE = "encode.decode"
    PREPROCESS = "encode.preprocess"
    VISION = "encode.vision"
    PRUNE = "encode.prune"
    PROJECT = "encode.project"
    QUANTIZE = "encode.quantize"
    CACHE_PUT = "cache.put"
    STAGES = tuple(stage_span_name(s) for s in ENCODE_STAGES)


class ENCODE_ATTR:
    """Attribute keys on encode spans."""

    IMAGE_DIGEST = "visiongate.image.digest_prefix"
    BATCH_SIZE = "visiongate.encode.batch_size"
    TOKENS_KEPT = "visiongate.encode.tokens_kept"
    TOKENS_TOTAL = "visiongate.encode.tokens_total"
    ATTEMPT = "visiongate.encode.attempt"


_PROPAGATOR = TraceContextTextMapPropagator()


def parent_context(traceparent: str | None) -> Context:
    """A context whose parent is the remote span `traceparent` names; an empty context when it
    is missing or malformed."""
    carrier = {"traceparent": traceparent} if traceparent else {}
    return _PROPAGATOR.extract(carrier, context=Context())


def has_parent(context: Context) -> bool:
    """True when `context` continues a valid (local or remote) span."""
    return trace.get_current_span(context).get_span_context().is_valid


def lay_spans(
    tracer: Tracer,
    context: Context,
    start_ns: int,
    durations_ms: Mapping[str, float],
    attributes: Mapping[str, AttributeValue] | None = None,
) -> int:
    """Record finished child spans of `context`, one per `durations_ms` entry (span name ->
    ms) in its order, laid end to end from `start_ns` (epoch ns). Returns the last end."""
    attrs = dict(attributes or {})
    cursor = int(start_ns)
    for name, ms in durations_ms.items():
        end = cursor + max(round(float(ms) * 1_000_000), 0)
        span = tracer.start_span(name, context=context, start_time=cursor, attributes=attrs)
        span.end(end_time=end)
        cursor = end
    return cursor
