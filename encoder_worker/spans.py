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

    from encoder_worker.jobs import EncodeJob
    from encoder_worker.types import EncodedImage

__all__ = (
    "ENCODE_ATTR",
    "ENCODE_SPAN",
    "STAGE_PREFIX",
    "has_parent",
    "lay_spans",
    "parent_context",
    "stage_span_name",
    "trace_encoded",
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


def trace_encoded(
    tracer: Tracer,
    job: EncodeJob,
    image: EncodedImage,
    started_ns: int,
    stages_ms: Mapping[str, float],
    put_ms: float,
    batch_size: int,
    queue_ms: float,
) -> None:
    """Record one job a worker encoded: its wait in the queue, the pipeline's stages (from
    `started_ns`, epoch ns, when the batch began) and the write of its tokens, under the
    caller's span (the job's `traceparent`), or under a root span of the job's own when it has
    none or a malformed one."""
    attrs = {ENCODE_ATTR.BATCH_SIZE: batch_size, ENCODE_ATTR.IMAGE_DIGEST: job.digest[:12]}
    root = None
    parent = parent_context(job.traceparent)
    if not has_parent(parent):  # none, or malformed
        root = tracer.start_span(
            ENCODE_SPAN.JOB,
            context=parent,
            start_time=min(job.enqueued_ns, started_ns),
            attributes={**attrs, ENCODE_ATTR.ATTEMPT: job.attempt},
        )
        parent = trace.set_span_in_context(root)
    if job.enqueued_ns < started_ns:
        lay_spans(tracer, parent, job.enqueued_ns, {ENCODE_SPAN.QUEUE: queue_ms}, attrs)
    cursor = lay_spans(
        tracer,
        parent,
        started_ns,
        {stage_span_name(k): ms for k, ms in stages_ms.items()},
        {
            **attrs,
            ENCODE_ATTR.TOKENS_KEPT: image.tokens_kept,
            ENCODE_ATTR.TOKENS_TOTAL: image.tokens_total,
        },
    )
    end = lay_spans(tracer, parent, cursor, {ENCODE_SPAN.CACHE_PUT: put_ms}, attrs)
    if root is not None:
        root.end(end_time=end)
