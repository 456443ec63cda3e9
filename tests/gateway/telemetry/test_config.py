"""OTEL_* variables -> export targets."""

from __future__ import annotations

import pytest

from gateway.telemetry import OTLPTarget, config_from_env


def test_nothing_exported_without_endpoint() -> None:
    config = config_from_env({})
    assert config.traces is None and config.metrics is None
    assert config.service_name == "visiongate"


def test_generic_endpoint_http_appends_signal_paths() -> None:
    config = config_from_env(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/", "OTEL_SERVICE_NAME": "vg-a"}
    )
    assert config.traces == OTLPTarget("http://collector:4318/v1/traces", "http/protobuf")
    assert config.metrics == OTLPTarget("http://collector:4318/v1/metrics", "http/protobuf")
    assert config.service_name == "vg-a"


def test_signal_endpoint_used_as_is_and_grpc() -> None:
    config = config_from_env(
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://tempo:4317",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        }
    )
    assert config.traces == OTLPTarget("http://tempo:4317", "grpc")
    assert config.metrics is None


def test_exporter_none_and_sdk_disabled() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_METRICS_EXPORTER": "none"}
    config = config_from_env(env)
    assert config.traces is not None and config.metrics is None
    disabled = config_from_env({**env, "OTEL_SDK_DISABLED": "true"})
    assert disabled.traces is None and disabled.sdk_disabled


def test_interval_and_bad_values() -> None:
    assert config_from_env({"OTEL_METRIC_EXPORT_INTERVAL": "250"}).metric_export_interval_ms == 250
    with pytest.raises(ValueError, match="protocol"):
        config_from_env(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_EXPORTER_OTLP_PROTOCOL": "x"}
        )
    with pytest.raises(ValueError, match="OTEL_METRIC_EXPORT_INTERVAL"):
        config_from_env({"OTEL_METRIC_EXPORT_INTERVAL": "soon"})


def test_exemplars_only_where_an_otlp_reader_carries_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter

    from gateway.telemetry._telemetry import _exemplar_filter

    monkeypatch.delenv("OTEL_METRICS_EXEMPLAR_FILTER", raising=False)
    prometheus_only = config_from_env({})
    assert isinstance(_exemplar_filter(prometheus_only), AlwaysOffExemplarFilter)
    with_otlp = config_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert _exemplar_filter(with_otlp) is None  # the SDK's trace-based filter
    monkeypatch.setenv("OTEL_METRICS_EXEMPLAR_FILTER", "always_on")
    assert _exemplar_filter(prometheus_only) is None  # asked for: the SDK reads the variable
