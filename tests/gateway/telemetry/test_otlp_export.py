"""OTLP export over HTTP/protobuf and gRPC, received by real protobuf decoders."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from gateway.telemetry import SPAN, setup_telemetry
from gateway.testing.otlp_receiver import OTLPReceiver
from tests.conftest import free_port


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as r:
        yield r


def _one_response(t) -> None:
    with t.response_span(model="smol", api="realtime", response_id="r1", session_id="s1") as root:
        t.stage_spans(None, time.time_ns(), {"preprocess": 2.0, "vision": 9.0})
        root.add_event(SPAN.EVENT_TTFT)
    t.metrics.record_response(
        model="smol",
        status="completed",
        ttft_s=0.8,
        duration_s=2.0,
        output_tokens=5,
        input_tokens=9,
        image_tokens=64,
        cached_tokens=0,
        time_per_output_token_s=0.05,
        api="realtime",
    )


def test_http_protobuf_export(receiver: OTLPReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "visiongate-test")
    t = setup_telemetry("9.9.9", "inst-1", log_level="warning")
    try:
        _one_response(t)
        t.force_flush()
        spans = receiver.wait_for_spans(lambda s: len(s) >= 3)
        by_name = {s.name: s for s in spans}
        root = by_name["chat smol"]
        assert root.parent_span_id == ""
        assert root.attributes["gen_ai.request.model"] == "smol"
        assert root.attributes["gen_ai.conversation.id"] == "s1"
        assert [e.name for e in root.events] == ["ttft"]
        assert root.resource["service.name"] == "visiongate-test"
        assert root.resource["service.version"] == "9.9.9"
        assert root.resource["service.instance.id"] == "inst-1"
        for name in ("encode.preprocess", "encode.vision"):
            assert by_name[name].parent_span_id == root.span_id
            assert by_name[name].trace_id == root.trace_id
        assert by_name["encode.vision"].duration_ms == pytest.approx(9.0)

        points = receiver.wait_for_metrics(
            lambda ps: any(p.name == "gen_ai.server.time_to_first_token" for p in ps)
        )
        ttft = next(p for p in points if p.name == "gen_ai.server.time_to_first_token")
        assert ttft.kind == "histogram" and ttft.count == 1 and ttft.sum == pytest.approx(0.8)
        assert ttft.unit == "s" and ttft.explicit_bounds[0] == 0.05
        assert ttft.attributes["gen_ai.request.model"] == "smol"
        responses = next(p for p in points if p.name == "visiongate.responses")
        assert responses.kind == "sum" and responses.value == 1
    finally:
        t.shutdown()


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []

    def Export(self, request, context):
        self.requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def test_grpc_export(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    traces, metrics = _Traces(), _Metrics()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(traces, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(metrics, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    t = setup_telemetry("1.0", log_level="warning")
    try:
        _one_response(t)
        t.force_flush()
        names = {
            s.name
            for req in traces.requests
            for rs in req.resource_spans
            for ss in rs.scope_spans
            for s in ss.spans
        }
        assert {"chat smol", "encode.preprocess", "encode.vision"} <= names
        metric_names = {
            m.name
            for req in metrics.requests
            for rm in req.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
        }
        assert "gen_ai.server.time_to_first_token" in metric_names
    finally:
        t.shutdown()
        server.stop(0)
