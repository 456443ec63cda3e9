"""Spans are recorded only while something receives them.

A tracer provider without a span processor (no OTLP endpoint configured, nothing attached)
still builds every span in full (attributes cleaned and copied, events, ids) and then hands it
to no one: per response that is the root span and its four or five children. `Receivers` is the
provider's span processor list, noting when the first processor joins it (an exporter at start,
or one attached later, as the tests attach an in-memory one), and `WhileReceived` samples as the
configured sampler does from then on and drops every span before (the SDK's always-off
decision: a non-recording span that still has a valid trace id, so log lines keep their
`trace_id` and W3C `traceparent`s still propagate, marked not sampled).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from opentelemetry.sdk.trace import SpanProcessor, SynchronousMultiSpanProcessor, sampling

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, SpanKind
    from opentelemetry.trace.span import TraceState
    from opentelemetry.util.types import Attributes

__all__ = ("Receivers", "WhileReceived", "configured_sampler")


class Receivers(SynchronousMultiSpanProcessor):
    """A tracer provider's span processors; `receiving` once the first one is added."""

    receiving = False

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        self.receiving = True


class WhileReceived(sampling.Sampler):
    """`inner`'s decisions once `receivers` has a processor; before, every span is dropped."""

    def __init__(self, inner: sampling.Sampler, receivers: Receivers) -> None:
        self._inner = inner
        self._receivers = receivers

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> sampling.SamplingResult:
        sampler = self._inner if self._receivers.receiving else sampling.ALWAYS_OFF
        return sampler.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"WhileReceived{{{self._inner.get_description()}}}"


def configured_sampler() -> sampling.Sampler:
    """The sampler OTEL_TRACES_SAMPLER (and its argument) names, the SDK's default without one
    (parent-based, always on)."""
    from_env = getattr(sampling, "_get_from_env_or_default", None)
    return from_env() if from_env is not None else sampling.ParentBased(sampling.ALWAYS_ON)
