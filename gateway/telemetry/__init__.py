"""Traces, metrics and logs of the gateway.

`setup_telemetry` builds a `Telemetry` (tracer and meter providers configured from ``OTEL_*``,
a private Prometheus registry for ``/metrics``) and configures structlog. Serving code records
metrics through `Telemetry.metrics` (`GatewayMetrics`; its scheduler gauges read an engine's
`SchedulerStats` snapshot), opens one ``chat <model>`` span per response, and passes encode
jobs a W3C ``traceparent`` (`traceparent`, `context_from_traceparent`) so worker spans join the
response's trace.
"""

from __future__ import annotations

from gateway.telemetry._instruments import METRICS, PROMETHEUS_NAMES, metric_views
from gateway.telemetry._litestar import EXCLUDED_PATHS, litestar_plugin
from gateway.telemetry._logging import (
    add_trace_ids,
    configure_logging,
    log_response,
    register_secrets,
)
from gateway.telemetry._metrics import GatewayMetrics
from gateway.telemetry._otel_config import OTLPTarget, TelemetryConfig, config_from_env
from gateway.telemetry._scheduler_gauges import SchedulerStats
from gateway.telemetry._telemetry import NoopTelemetry, Telemetry, setup_telemetry
from gateway.telemetry._tracing import (
    ATTR,
    SPAN,
    context_from_traceparent,
    record_stage_spans,
    response_span_name,
    traceparent,
)

__all__ = (
    "ATTR",
    "EXCLUDED_PATHS",
    "METRICS",
    "PROMETHEUS_NAMES",
    "SPAN",
    "GatewayMetrics",
    "NoopTelemetry",
    "OTLPTarget",
    "SchedulerStats",
    "Telemetry",
    "TelemetryConfig",
    "add_trace_ids",
    "config_from_env",
    "configure_logging",
    "context_from_traceparent",
    "litestar_plugin",
    "log_response",
    "metric_views",
    "record_stage_spans",
    "register_secrets",
    "response_span_name",
    "setup_telemetry",
    "traceparent",
)
