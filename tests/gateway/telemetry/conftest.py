"""Fixtures: a `Telemetry` with no OTLP export and an in-memory span exporter attached."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.telemetry import Telemetry, config_from_env


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    t = Telemetry(config_from_env({}), "0.0.0-test", "test-instance")
    yield t
    t.shutdown()


@pytest.fixture
def span_exporter(telemetry: Telemetry) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    telemetry.tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter
