"""A minimal OTLP/HTTP (protobuf) receiver for tests.

It accepts ``POST /v1/traces``, ``/v1/metrics`` and ``/v1/logs`` on a loopback port, decodes the
bodies with the official ``opentelemetry-proto`` messages and keeps them, flattened, for
assertions. It is what a Collector's ``otlp`` receiver would see from the gateway.

    receiver = OTLPReceiver().start()
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
    ...
    spans = receiver.wait_for_spans(lambda spans: any(s.name == "chat m" for s in spans))
    receiver.stop()
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

import msgspec
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

__all__ = (
    "OTLPReceiver",
    "ReceivedEvent",
    "ReceivedLink",
    "ReceivedPoint",
    "ReceivedSpan",
    "any_value",
    "flatten_spans",
)


class ReceivedEvent(msgspec.Struct, frozen=True):
    name: str
    time_unix_nano: int
    attributes: dict[str, Any]


class ReceivedLink(msgspec.Struct, frozen=True):
    """A span link: the span it points to (lowercase hex ids)."""

    trace_id: str
    span_id: str
    attributes: dict[str, Any]


class ReceivedSpan(msgspec.Struct, frozen=True):
    """One span as exported; ids are lowercase hex, ``parent_span_id`` is "" for a root."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_time_unix_nano: int
    end_time_unix_nano: int
    attributes: dict[str, Any]
    events: list[ReceivedEvent]
    status_code: int
    scope: str
    resource: dict[str, Any]
    links: list[ReceivedLink] = []

    @property
    def duration_ms(self) -> float:
        return (self.end_time_unix_nano - self.start_time_unix_nano) / 1e6


class ReceivedPoint(msgspec.Struct, frozen=True):
    """One metric data point. ``value`` for sums and gauges; ``count``/``sum``/``bucket_counts``/
    ``explicit_bounds`` for histograms."""

    name: str
    kind: str  # "sum" | "gauge" | "histogram"
    unit: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    value: float | None = None
    count: int | None = None
    sum: float | None = None
    bucket_counts: list[int] = []
    explicit_bounds: list[float] = []


def any_value(v: Any) -> Any:
    """Decode an OTLP ``AnyValue`` into the matching Python value."""
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


_ROUTES: dict[str, tuple[type, type, str]] = {
    "/v1/traces": (ExportTraceServiceRequest, ExportTraceServiceResponse, "traces"),
    "/v1/metrics": (ExportMetricsServiceRequest, ExportMetricsServiceResponse, "metrics"),
    "/v1/logs": (ExportLogsServiceRequest, ExportLogsServiceResponse, "logs"),
}


class OTLPReceiver:
    """OTLP/HTTP protobuf receiver on ``127.0.0.1`` (a free port unless given)."""

    def __init__(self, port: int = 0) -> None:
        self._lock = threading.Lock()
        self._requests: dict[str, list[Any]] = {"traces": [], "metrics": [], "logs": []}
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        """Base URL for ``OTEL_EXPORTER_OTLP_ENDPOINT`` (exporters append ``/v1/<signal>``)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def clear(self) -> None:
        with self._lock:
            for requests in self._requests.values():
                requests.clear()

    def requests(self, signal: str) -> list[Any]:
        """The decoded protobuf requests received for ``signal`` (traces/metrics/logs)."""
        with self._lock:
            return list(self._requests[signal])

    def spans(self) -> list[ReceivedSpan]:
        return flatten_spans(self.requests("traces"))

    def metrics(self) -> list[ReceivedPoint]:
        out: list[ReceivedPoint] = []
        for req in self.requests("metrics"):
            for rm in req.resource_metrics:
                resource = _attrs(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        out.extend(_points(m, resource))
        return out

    def wait_for_spans(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 10.0
    ) -> list[ReceivedSpan]:
        return _wait(self.spans, predicate, timeout, "spans")

    def wait_for_metrics(
        self, predicate: Callable[[list[ReceivedPoint]], bool], timeout: float = 10.0
    ) -> list[ReceivedPoint]:
        return _wait(self.metrics, predicate, timeout, "metrics")

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                route = _ROUTES.get(self.path.split("?", 1)[0])
                if route is None:
                    self.send_error(404)
                    return
                request_type, response_type, signal = route
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                message = request_type()
                try:
                    message.ParseFromString(body)
                except Exception:
                    self.send_error(400, "body is not an OTLP protobuf request")
                    return
                with receiver._lock:
                    receiver._requests[signal].append(message)
                payload = response_type().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                return

        return Handler


def flatten_spans(requests: Iterable[Any]) -> list[ReceivedSpan]:
    """Every span of decoded ``ExportTraceServiceRequest`` messages, flattened, in order: what
    this receiver got over HTTP, or what a Collector published to Kafka as OTLP protobuf."""
    out: list[ReceivedSpan] = []
    for req in requests:
        for rs in req.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(
                        ReceivedSpan(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            kind=int(s.kind),
                            start_time_unix_nano=int(s.start_time_unix_nano),
                            end_time_unix_nano=int(s.end_time_unix_nano),
                            attributes=_attrs(s.attributes),
                            events=[_event(e) for e in s.events],
                            status_code=int(s.status.code),
                            scope=ss.scope.name,
                            resource=resource,
                            links=[
                                ReceivedLink(
                                    link.trace_id.hex(), link.span_id.hex(), _attrs(link.attributes)
                                )
                                for link in s.links
                            ],
                        )
                    )
    return out


def _event(e: Any) -> ReceivedEvent:
    return ReceivedEvent(e.name, int(e.time_unix_nano), _attrs(e.attributes))


def _points(m: Any, resource: dict[str, Any]) -> list[ReceivedPoint]:
    which = m.WhichOneof("data")
    out: list[ReceivedPoint] = []
    if which in ("sum", "gauge"):
        for p in getattr(m, which).data_points:
            value = p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
            out.append(ReceivedPoint(m.name, which, m.unit, _attrs(p.attributes), resource, value))
    elif which == "histogram":
        for p in m.histogram.data_points:
            out.append(
                ReceivedPoint(
                    m.name,
                    "histogram",
                    m.unit,
                    _attrs(p.attributes),
                    resource,
                    count=int(p.count),
                    sum=float(p.sum),
                    bucket_counts=[int(c) for c in p.bucket_counts],
                    explicit_bounds=[float(b) for b in p.explicit_bounds],
                )
            )
    return out


def _wait(
    fetch: Callable[[], list[Any]],
    predicate: Callable[[list[Any]], bool],
    timeout: float,
    what: str,
) -> list[Any]:
    deadline = time.monotonic() + timeout
    while True:
        items = fetch()
        if predicate(items):
            return items
        if time.monotonic() > deadline:
            raise AssertionError(f"no matching {what} within {timeout}s; got {len(items)}")
        time.sleep(0.05)
