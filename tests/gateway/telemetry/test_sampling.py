"""Spans are recorded only while a span processor receives them (gateway/telemetry/_sampling.py):
before one is attached they are dropped, with valid trace ids; from then on the configured
sampler decides."""

from __future__ import annotations

import io
import json

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.telemetry import Telemetry, config_from_env, configure_logging, log_response
from gateway.testing.ports import free_port


def _telemetry(env: dict[str, str] | None = None) -> Telemetry:
    return Telemetry(config_from_env(env or {}), "0.0.0-test", "test-instance")


def test_nothing_is_recorded_until_a_processor_receives_it() -> None:
    t = _telemetry()
    try:
        early = t.tracer.start_span("early")
        assert not early.is_recording()
        assert early.get_span_context().is_valid  # log lines and traceparents keep an id
        assert not early.get_span_context().trace_flags.sampled
        early.end()
        exporter = InMemorySpanExporter()
        t.tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
        later = t.tracer.start_span("later", attributes={"k": "v"})
        assert later.is_recording()
        later.end()
        assert [(s.name, dict(s.attributes or {})) for s in exporter.get_finished_spans()] == [
            ("later", {"k": "v"})
        ]
    finally:
        t.shutdown()


def test_a_dropped_span_still_gives_the_log_line_its_trace_id() -> None:
    t = _telemetry()
    stream = io.StringIO()
    configure_logging("info", json=True, stream=stream)
    try:
        span = t.tracer.start_span("response")
        with trace.use_span(span, end_on_exit=True):
            log_response(
                api="realtime",
                model="m",
                status="completed",
                session_id=None,
                response_id="resp_1",
                timings_ms={},
                usage={},
            )
        (line,) = [json.loads(x) for x in stream.getvalue().splitlines() if '"resp_1"' in x]
        assert line["trace_id"] == format(span.get_span_context().trace_id, "032x")
    finally:
        configure_logging("info", json=True)
        t.shutdown()


def test_the_configured_sampler_decides_once_spans_are_received(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    t = _telemetry()
    try:
        exporter = InMemorySpanExporter()
        t.tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
        span = t.tracer.start_span("off")
        assert not span.is_recording()
        span.end()
        assert not exporter.get_finished_spans()
    finally:
        t.shutdown()


def test_an_otlp_endpoint_receives_from_the_start() -> None:
    # nothing listens there: the span is never ended, so nothing is sent
    t = _telemetry({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}"})
    try:
        assert t.tracer.start_span("first").is_recording()
    finally:
        t.shutdown()
