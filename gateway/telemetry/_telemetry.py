"""`Telemetry`: one process's (or one app's) tracer provider, meter provider and /metrics text.

Each `Telemetry` owns its providers and a private Prometheus registry, so several gateways in one
process never share instruments or spans. OTLP exporters are attached only when an endpoint is
configured; without one, metrics are only served on ``/metrics`` and spans are not recorded
until a span processor is attached (`_sampling`: they would go nowhere).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, ExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry, generate_latest

from gateway.telemetry._instruments import metric_views
from gateway.telemetry._logging import configure_logging
from gateway.telemetry._metrics import GatewayMetrics
from gateway.telemetry._otel_config import OTLPTarget, TelemetryConfig, config_from_env
from gateway.telemetry._sampling import Receivers, WhileReceived, configured_sampler
from gateway.telemetry._tracing import ATTR, record_stage_spans, response_span_name

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.metrics.export import MetricExporter
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span
    from opentelemetry.util.types import AttributeValue

__all__ = ("PROMETHEUS_CONTENT_TYPE", "Telemetry", "setup_telemetry")

# The classic text format: every Prometheus release parses it, and our names are all legacy-safe.
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_SCOPE = "visiongate"
_globals_lock = threading.Lock()
_globals_installed = False


def _span_exporter(target: OTLPTarget) -> SpanExporter:
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc(endpoint=target.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http(endpoint=target.endpoint)


def _metric_exporter(target: OTLPTarget) -> MetricExporter:
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as Grpc,
        )

        return Grpc(endpoint=target.endpoint)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Http

    return Http(endpoint=target.endpoint)


def _exemplar_filter(config: TelemetryConfig) -> ExemplarFilter | None:
    """Exemplars reach an OTLP metrics exporter only (the Prometheus reader drops them): without
    one, no measurement is offered to an exemplar reservoir, unless
    OTEL_METRICS_EXEMPLAR_FILTER asks for it. None: the SDK's choice (trace-based)."""
    if config.metrics is not None or "OTEL_METRICS_EXEMPLAR_FILTER" in os.environ:
        return None
    return AlwaysOffExemplarFilter()


class Telemetry:
    """Tracer, meter and metrics of one gateway. Build it with `setup_telemetry`."""

    def __init__(
        self, config: TelemetryConfig, service_version: str, instance_id: str | None = None
    ) -> None:
        self.config = config
        self.instance_id = instance_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        # Resource.create also merges OTEL_RESOURCE_ATTRIBUTES; ours win on conflict.
        self.resource = Resource.create(
            {
                "service.name": config.service_name,
                "service.version": service_version,
                "service.instance.id": self.instance_id,
                "service.namespace": "visiongate",
            }
        )
        receivers = Receivers()
        self.tracer_provider = TracerProvider(
            sampler=WhileReceived(configured_sampler(), receivers),
            resource=self.resource,
            active_span_processor=receivers,
        )
        if config.traces is not None:
            exporter = _span_exporter(config.traces)
            self.tracer_provider.add_span_processor(BatchSpanProcessor(exporter))

        self.registry = CollectorRegistry(auto_describe=False)
        readers: list[MetricReader] = [
            PrometheusMetricReader(registry=self.registry, scope_info_enabled=False)
        ]
        if config.metrics is not None:
            readers.append(
                PeriodicExportingMetricReader(
                    _metric_exporter(config.metrics),
                    export_interval_millis=config.metric_export_interval_ms,
                    export_timeout_millis=config.metric_export_timeout_ms,
                )
            )
        self.meter_provider = MeterProvider(
            resource=self.resource,
            metric_readers=readers,
            views=metric_views(),
            exemplar_filter=_exemplar_filter(config),
        )
        self.tracer: trace.Tracer = self.tracer_provider.get_tracer(_SCOPE, service_version)
        self.meter: otel_metrics.Meter = self.meter_provider.get_meter(_SCOPE, service_version)
        self.metrics = GatewayMetrics(self.meter)
        self._shutdown = False
        self._lock = threading.Lock()

    def prometheus_text(self) -> tuple[bytes, str]:
        """The current metrics in Prometheus text format: ``(body, content_type)``."""
        return generate_latest(self.registry), PROMETHEUS_CONTENT_TYPE

    @contextlib.contextmanager
    def response_span(
        self,
        *,
        model: str,
        api: str,
        response_id: str,
        session_id: str | None = None,
        provider: str = "visiongate",
        parent: Context | None = None,
    ) -> Iterator[Span]:
        """Start the root span of one response (``chat <model>``) and make it current.
        Set ``ATTR.INPUT_TOKENS``/``ATTR.OUTPUT_TOKENS`` on it once usage is known."""
        attributes: dict[str, AttributeValue] = {
            ATTR.OPERATION: "chat",
            ATTR.PROVIDER: provider,
            ATTR.REQUEST_MODEL: model,
            ATTR.RESPONSE_ID: response_id,
            ATTR.API: api,
        }
        if session_id:
            attributes[ATTR.SESSION_ID] = session_id
        with self.tracer.start_as_current_span(
            response_span_name(model), context=parent, kind=SpanKind.SERVER, attributes=attributes
        ) as span:
            yield span

    def stage_spans(
        self,
        parent_context: Context | Span | None,
        start_ns: int,
        timings_ms: Mapping[str, float],
        prefix: str = "encode.",
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> int:
        """Record finished child spans of ``parent_context`` from measured durations laid end to
        end from ``start_ns`` (``time.time_ns()`` clock). Returns the last span's end time."""
        return record_stage_spans(
            self.tracer, parent_context, start_ns, timings_ms, prefix, attributes
        )

    def force_flush(self, timeout_ms: int = 10_000) -> None:
        """Push buffered spans and metrics to their exporters now."""
        self.tracer_provider.force_flush(timeout_ms)
        self.meter_provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Flush and shut down both providers. Idempotent; later recordings are dropped."""
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()

    def install_global(self) -> None:
        """Make this instance's providers the process-wide OTel defaults (once per process;
        OTel refuses to replace them later)."""
        global _globals_installed
        with _globals_lock:
            if _globals_installed:
                return
            trace.set_tracer_provider(self.tracer_provider)
            otel_metrics.set_meter_provider(self.meter_provider)
            _globals_installed = True


class NoopTelemetry(Telemetry):
    """Telemetry that records nothing, behind the same API: OpenTelemetry's no-op tracer and
    meter, an empty ``/metrics``. For parts built without a gateway around them (unit tests,
    scripts), so serving code never checks whether telemetry exists."""

    def __init__(self) -> None:
        self.config = TelemetryConfig()
        self.instance_id = "noop"
        self.tracer = trace.NoOpTracer()
        self.meter = otel_metrics.NoOpMeter(_SCOPE)
        self.metrics = GatewayMetrics(self.meter)
        self.registry = CollectorRegistry(auto_describe=False)
        self._shutdown = True
        self._lock = threading.Lock()

    def force_flush(self, timeout_ms: int = 10_000) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def install_global(self) -> None:
        return None


def setup_telemetry(
    service_version: str,
    instance_id: str | None = None,
    *,
    log_level: str = "info",
    env: Mapping[str, str] | None = None,
    set_global: bool = False,
    **logging_options: Any,
) -> Telemetry:
    """Configure logging and build an independent `Telemetry` from ``OTEL_*`` variables read
    now (``env`` overrides ``os.environ``). ``set_global=True`` also installs its providers as
    the process defaults, for the CLI's single gateway; tests leave it off."""
    configure_logging(log_level, **logging_options)
    telemetry = Telemetry(config_from_env(env), service_version, instance_id)
    if set_global:
        telemetry.install_global()
    return telemetry
