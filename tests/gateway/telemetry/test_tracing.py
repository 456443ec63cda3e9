"""Span shape of one response: root attributes, stage spans from measured timings, and the
traceparent hand-off to an encoder running on another thread."""

from __future__ import annotations

import threading
import time

from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.telemetry import (
    ATTR,
    SPAN,
    Telemetry,
    context_from_traceparent,
    traceparent,
)


def test_response_span_attributes_and_ttft_event(
    telemetry: Telemetry, span_exporter: InMemorySpanExporter
) -> None:
    with telemetry.response_span(
        model="smol", api="realtime", response_id="resp_1", session_id="sess_1"
    ) as root:
        with telemetry.tracer.start_as_current_span(SPAN.LLM_PREFILL) as prefill:
            prefill.set_attributes({ATTR.PREFILL_TOKENS: 12, ATTR.REUSED_KV_TOKENS: 40})
        root.add_event(SPAN.EVENT_TTFT, {ATTR.TTFT_MS: 123.0})
        root.set_attributes({ATTR.INPUT_TOKENS: 52, ATTR.OUTPUT_TOKENS: 7})
    spans = {s.name: s for s in span_exporter.get_finished_spans()}
    root_span = spans["chat smol"]
    assert root_span.parent is None
    assert root_span.kind is trace.SpanKind.SERVER
    attrs = dict(root_span.attributes or {})
    assert attrs[ATTR.OPERATION] == "chat" and attrs[ATTR.REQUEST_MODEL] == "smol"
    assert attrs[ATTR.PROVIDER] == "visiongate"
    assert attrs[ATTR.SESSION_ID] == "sess_1" and attrs[ATTR.RESPONSE_ID] == "resp_1"
    assert attrs[ATTR.INPUT_TOKENS] == 52 and attrs[ATTR.OUTPUT_TOKENS] == 7
    assert [e.name for e in root_span.events] == ["ttft"]
    assert spans["llm.prefill"].parent.span_id == root_span.context.span_id
    assert root_span.resource.attributes["service.instance.id"] == "test-instance"


def test_stage_spans_are_laid_end_to_end(
    telemetry: Telemetry, span_exporter: InMemorySpanExporter
) -> None:
    timings = {"preprocess": 3.5, "vision": 41.0, "prune": 0.75, "encode.quantize": 1.25}
    start = time.time_ns()
    with telemetry.tracer.start_as_current_span("encode") as parent:
        end = telemetry.stage_spans(parent, start, timings, attributes={ATTR.BATCH_SIZE: 2})
    finished = span_exporter.get_finished_spans()
    stages = [s for s in finished if s.name != "encode"]
    assert [s.name for s in stages] == [
        SPAN.ENCODE_PREPROCESS,
        SPAN.ENCODE_VISION,
        SPAN.ENCODE_PRUNE,
        SPAN.ENCODE_QUANTIZE,
    ]
    parent_id = parent.get_span_context().span_id
    cursor = start
    for span, ms in zip(stages, timings.values(), strict=True):
        assert span.parent is not None and span.parent.span_id == parent_id
        assert span.context.trace_id == parent.get_span_context().trace_id
        assert span.start_time == cursor
        assert span.end_time - span.start_time == round(ms * 1e6)
        assert span.attributes[ATTR.BATCH_SIZE] == 2
        cursor = span.end_time
    assert end == cursor == start + round(sum(timings.values()) * 1e6)


def test_traceparent_joins_worker_spans_to_the_response(
    telemetry: Telemetry, span_exporter: InMemorySpanExporter
) -> None:
    job: dict[str, str | None] = {}
    with telemetry.tracer.start_as_current_span(SPAN.ENCODE_QUEUE) as queue_span:
        job["traceparent"] = traceparent()
    assert job["traceparent"] is not None and job["traceparent"].startswith("00-")

    def worker() -> None:  # a separate thread has no current span: only the job carries it
        ctx = context_from_traceparent(job["traceparent"])
        telemetry.stage_spans(ctx, time.time_ns(), {"vision": 5.0})

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    vision = next(s for s in span_exporter.get_finished_spans() if s.name == "encode.vision")
    assert vision.context.trace_id == queue_span.get_span_context().trace_id
    assert vision.parent.span_id == queue_span.get_span_context().span_id
    assert vision.parent.is_remote


def test_missing_or_bad_traceparent_starts_a_new_trace(
    telemetry: Telemetry, span_exporter: InMemorySpanExporter
) -> None:
    assert traceparent() is None  # no current span
    for value in (None, "garbage"):
        telemetry.stage_spans(context_from_traceparent(value), time.time_ns(), {"vision": 1.0})
    for span in span_exporter.get_finished_spans():
        assert span.parent is None


def test_worker_and_gateway_name_encode_spans_alike(
    telemetry: Telemetry, span_exporter: InMemorySpanExporter
) -> None:
    """An encode traces the same in the gateway's process and in a worker: the worker's spans
    (recorded as `EncoderWorker` records a finished job) carry the gateway's names."""
    from types import SimpleNamespace

    from encoder_worker.jobs import EncodeJob
    from encoder_worker.types import ENCODE_STAGES, EncodedImage
    from encoder_worker.worker import EncoderWorker

    timings = {stage: 1.0 + i for i, stage in enumerate(ENCODE_STAGES)}
    now = time.time_ns()
    with telemetry.tracer.start_as_current_span(SPAN.IMAGE_RESOLVE) as caller:
        telemetry.stage_spans(caller, now, timings)
        job_parent = traceparent()
    in_gateway = [s.name for s in span_exporter.get_finished_spans() if s.name.startswith("enc")]
    assert {
        SPAN.ENCODE_PREPROCESS,
        SPAN.ENCODE_VISION,
        SPAN.ENCODE_PRUNE,
        SPAN.ENCODE_QUANTIZE,
    } <= set(in_gateway)
    span_exporter.clear()

    pipeline = SimpleNamespace(fingerprint="f" * 64, config=SimpleNamespace(max_batch=1))
    worker = EncoderWorker(
        "redis://127.0.0.1:1/0", pipeline, tracer=telemetry.tracer, metrics=telemetry.metrics
    )
    job = EncodeJob("j1", "d" * 64, "f" * 64, 8, None, job_parent, now - 2_000_000)
    image = EncodedImage(
        "d" * 64, "f" * 64, 3, 9, 8, payload=None, timings_ms={**timings, "batch_size": 1}
    )
    worker._observe(job, image, now, put_ms=0.5)
    spans = span_exporter.get_finished_spans()
    assert [s.name for s in spans] == [SPAN.ENCODE_QUEUE, *in_gateway, SPAN.CACHE_PUT]
    caller_ctx = caller.get_span_context()
    for span in spans:
        assert span.context.trace_id == caller_ctx.trace_id
        assert span.parent.span_id == caller_ctx.span_id
        assert span.attributes[ATTR.BATCH_SIZE] == 1
        assert span.attributes[ATTR.IMAGE_DIGEST] == "d" * 12
    vision = next(s for s in spans if s.name == SPAN.ENCODE_VISION)
    assert (vision.attributes[ATTR.TOKENS_KEPT], vision.attributes[ATTR.TOKENS_TOTAL]) == (3, 9)
    body, _ = telemetry.prometheus_text()
    assert b'stage="vision"' in body  # the encode metrics went to the gateway's recorder
