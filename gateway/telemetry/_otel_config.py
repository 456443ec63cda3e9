"""Telemetry configuration read from the standard ``OTEL_*`` environment variables.

Only what decides *whether and where* to export is resolved here; the SDK's own knobs
(``OTEL_BSP_*``, ``OTEL_TRACES_SAMPLER``, ``OTEL_EXPORTER_OTLP_HEADERS``,
``OTEL_RESOURCE_ATTRIBUTES``) are left for the SDK to read when the exporters and providers
are built.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

import msgspec

__all__ = ("OTLPTarget", "TelemetryConfig", "config_from_env")

Protocol = Literal["http/protobuf", "grpc"]

_PROTOCOLS: tuple[str, ...] = ("http/protobuf", "grpc")
_DEFAULT_INTERVAL_MS = 60_000
_DEFAULT_TIMEOUT_MS = 30_000


class OTLPTarget(msgspec.Struct, frozen=True):
    """Where one signal goes: the full endpoint URL (``.../v1/traces`` for HTTP) and protocol."""

    endpoint: str
    protocol: Protocol


class TelemetryConfig(msgspec.Struct, frozen=True):
    """Resolved export settings. A ``None`` target means that signal is not exported over OTLP."""

    service_name: str = "visiongate"
    traces: OTLPTarget | None = None
    metrics: OTLPTarget | None = None
    metric_export_interval_ms: int = _DEFAULT_INTERVAL_MS
    metric_export_timeout_ms: int = _DEFAULT_TIMEOUT_MS
    sdk_disabled: bool = False


def _protocol(env: Mapping[str, str], signal: str) -> Protocol:
    raw = (
        (
            env.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL")
            or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        )
        .strip()
        .lower()
    )
    if raw not in _PROTOCOLS:
        raise ValueError(f"unsupported OTLP protocol {raw!r}; expected one of {_PROTOCOLS}")
    return raw  # type: ignore[return-value]


def _target(env: Mapping[str, str], signal: str, path: str) -> OTLPTarget | None:
    """Resolve one signal's endpoint per the OTLP exporter spec.

    The signal-specific variable is used as-is; the generic one is a base URL to which HTTP
    appends ``/v1/<signal>``. gRPC takes the same URL for every signal.
    """
    exporter = env.get(f"OTEL_{signal}_EXPORTER", "otlp").strip().lower()
    if exporter == "none":
        return None
    protocol = _protocol(env, signal)
    specific = env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT", "").strip()
    if specific:
        return OTLPTarget(endpoint=specific, protocol=protocol)
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if not base:
        return None
    if protocol == "grpc":
        return OTLPTarget(endpoint=base, protocol=protocol)
    return OTLPTarget(endpoint=base.rstrip("/") + path, protocol=protocol)


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(float(raw))
    except ValueError as exc:
        raise ValueError(f"{name} must be a number of milliseconds, got {raw!r}") from exc
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    return value


def config_from_env(env: Mapping[str, str] | None = None) -> TelemetryConfig:
    """Read the export settings from ``env`` (``os.environ`` at call time by default)."""
    env = os.environ if env is None else env
    disabled = env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    return TelemetryConfig(
        service_name=env.get("OTEL_SERVICE_NAME", "").strip() or "visiongate",
        traces=None if disabled else _target(env, "TRACES", "/v1/traces"),
        metrics=None if disabled else _target(env, "METRICS", "/v1/metrics"),
        metric_export_interval_ms=_int(env, "OTEL_METRIC_EXPORT_INTERVAL", _DEFAULT_INTERVAL_MS),
        metric_export_timeout_ms=_int(env, "OTEL_METRIC_EXPORT_TIMEOUT", _DEFAULT_TIMEOUT_MS),
        sdk_disabled=disabled,
    )
