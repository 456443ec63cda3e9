"""Scheduler telemetry on a real Prometheus exposition and real spans: gauges that follow the
engine's snapshot, the preemption counter, inter-token latency and TPOT from a recorded
response, and the prefill chunking / preemption attributes on `llm.prefill`."""

from __future__ import annotations

import time
from dataclasses import replace

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from gateway.chat.events import Finished
from gateway.chat.response_trace import ResponseTrace
from gateway.engine.interface import EngineStats, GenerationResult
from gateway.protocol.errors import GatewayError
from gateway.telemetry import ATTR, SPAN, Telemetry
from tests.gateway.telemetry.test_metrics import samples, value

SCHEDULER_SERIES = (
    "visiongate_scheduler_requests",
    "visiongate_scheduler_batch_size",
    "visiongate_scheduler_step_tokens",
    "visiongate_kv_blocks",
    "visiongate_scheduler_preemptions_total",
)


class SteppingEngine:
    """Only the `stats()` part of an engine: a snapshot the test moves between scrapes."""

    def __init__(self) -> None:
        self.snapshot = EngineStats(kv_blocks_total=64)
        self.calls = 0

    def stats(self) -> EngineStats:
        self.calls += 1
        return self.snapshot


def _register(telemetry: Telemetry, engine: object) -> None:
    telemetry.metrics.observe_gauges(
        active_sessions=lambda: 1,
        queue_depth=lambda: 0,
        cache_bytes=dict,
        engine_stats=getattr(engine, "stats", None),
    )


def _scheduler_rows(telemetry: Telemetry) -> list[tuple[str, dict[str, str], float]]:
    return [r for r in samples(telemetry) if r[0] in SCHEDULER_SERIES]


def test_scheduler_gauges_follow_the_engine(telemetry: Telemetry) -> None:
    engine = SteppingEngine()
    _register(telemetry, engine)
    rows = samples(telemetry)
    assert value(rows, "visiongate_scheduler_requests", state="running") == 0
    assert value(rows, "visiongate_kv_blocks", state="free") == 64
    assert value(rows, "visiongate_scheduler_preemptions_total") == 0

    engine.snapshot = EngineStats(
        running=8,
        waiting=5,
        batch_size=8,
        step_tokens=520,
        kv_blocks_used=50,
        kv_blocks_total=64,
        kv_blocks_cached=10,
        preemptions_total=2,
    )
    rows = samples(telemetry)
    assert value(rows, "visiongate_scheduler_requests", state="running") == 8
    assert value(rows, "visiongate_scheduler_requests", state="waiting") == 5
    assert value(rows, "visiongate_scheduler_batch_size") == 8
    assert value(rows, "visiongate_scheduler_step_tokens") == 520
    blocks = {lab["state"]: v for n, lab, v in rows if n == "visiongate_kv_blocks"}
    assert blocks == {"used": 50, "cached": 10, "free": 4}
    assert sum(blocks.values()) == 64
    assert value(rows, "visiongate_scheduler_preemptions_total") == 2

    engine.snapshot = replace(engine.snapshot, preemptions_total=9)
    assert value(samples(telemetry), "visiongate_scheduler_preemptions_total") == 9
    assert engine.calls >= 3 * len(SCHEDULER_SERIES)  # read at every scrape, not cached

    body, _ = telemetry.prometheus_text()
    types = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
    assert types["visiongate_scheduler_preemptions"] == "counter"  # rate() works on it
    assert types["visiongate_scheduler_requests"] == "gauge"
    assert types["visiongate_kv_blocks"] == "gauge"


def test_engine_without_stats_exports_no_scheduler_series(telemetry: Telemetry) -> None:
    _register(telemetry, object())  # today's one-at-a-time engine has no stats()
    rows = samples(telemetry)
    assert _scheduler_rows(telemetry) == []
    assert value(rows, "visiongate_sessions_active") == 1


def test_failing_or_torn_stats_never_break_a_scrape(telemetry: Telemetry) -> None:
    class Flaky:
        broken = True

        def stats(self) -> EngineStats:
            if self.broken:
                raise RuntimeError("scheduler is restarting")
            # used + cached momentarily above total (read mid-step): free is clamped at 0
            return EngineStats(kv_blocks_used=60, kv_blocks_cached=10, kv_blocks_total=64)

    engine = Flaky()
    _register(telemetry, engine)
    with capture_logs() as logs:
        rows = samples(telemetry)
        assert _scheduler_rows(telemetry) == []
    assert value(rows, "visiongate_sessions_active") == 1
    # two scrapes of five instruments while broken: one warning, not ten
    assert [e["event"] for e in logs] == ["engine_stats_failed"]
    engine.broken = False
    assert value(samples(telemetry), "visiongate_kv_blocks", state="free") == 0


def _result(**fields: object) -> GenerationResult:
    base: dict[str, object] = {
        "text": "a cat",
        "finish_reason": "stop",
        "input_tokens": 120,
        "image_tokens": 64,
        "output_tokens": 20,
        "cached_tokens": 100,
        "queue_ms": 4.0,
        "prefill_ms": 30.0,
        "decode_ms": 380.0,
        "ttft_ms": 40.0,
    }
    return GenerationResult(**{**base, **fields})  # type: ignore[arg-type]


def _finished(result: GenerationResult | None, status: str = "completed") -> Finished:
    timings = {
        "queue_ms": 4.0,
        "encode_ms": 0.0,
        "prefill_ms": 30.0,
        "ttft_ms": 45.0,
        "total_ms": 460.0,
        "decode_ms": result.decode_ms if result else 0.0,
    }
    if result is None:
        return Finished(
            "resp_f",
            "item_f",
            "failed",
            "",
            timings=timings,
            error=GatewayError("engine_error", "the engine stopped"),
        )
    return Finished(
        "resp_1",
        "item_1",
        status,
        result.text,  # type: ignore[arg-type]
        input_tokens=result.input_tokens,
        image_tokens=result.image_tokens,
        output_tokens=result.output_tokens,
        cached_tokens=result.cached_tokens,
        timings=timings,
    )


def test_recorded_response_feeds_itl_tpot_and_scheduler_spans(
    telemetry: Telemetry, span_exporter: InMemorySpanExporter
) -> None:
    # 19 gaps for 20 tokens: 17 quick steps, one behind a prefill chunk, one after preemption
    gaps = (10.0,) * 17 + (200.0, 400.0)
    result = _result(itl_ms=gaps, prefill_chunks=3, preemptions=1)
    trace = ResponseTrace(
        telemetry, model="smol", api="chat_completions", response_id="resp_1", session_id="sess_1"
    )
    trace.llm(time.time_ns(), result)
    trace.finish(_finished(result))

    spans = {s.name: s for s in span_exporter.get_finished_spans()}
    prefill = dict(spans[SPAN.LLM_PREFILL].attributes or {})
    assert prefill[ATTR.PREFILL_CHUNKS] == 3 and prefill[ATTR.PREEMPTIONS] == 1
    assert prefill[ATTR.PREFILL_TOKENS] == 20 and prefill[ATTR.REUSED_KV_TOKENS] == 100
    root = dict(spans["chat smol"].attributes or {})
    assert root[ATTR.ITL_P95_MS] == 400.0  # nearest rank: ceil(0.95 * 19) = the 19th gap

    rows = samples(telemetry)
    itl = "visiongate_llm_inter_token_latency_seconds"
    sel = {"gen_ai_request_model": "smol", "api": "chat_completions"}
    assert value(rows, f"{itl}_count", **sel) == 19
    assert abs(value(rows, f"{itl}_sum", **sel) - 0.77) < 1e-9
    assert value(rows, f"{itl}_bucket", le="0.01", **sel) == 17
    assert value(rows, f"{itl}_bucket", le="0.15", **sel) == 17
    assert value(rows, f"{itl}_bucket", le="0.2", **sel) == 18
    assert value(rows, f"{itl}_bucket", le="0.25", **sel) == 18  # the ITL objective's bound
    assert value(rows, f"{itl}_bucket", le="0.4", **sel) == 19
    tpot = "gen_ai_server_time_per_output_token_seconds"
    assert value(rows, f"{tpot}_count", **sel) == 1
    assert abs(value(rows, f"{tpot}_sum", **sel) - 0.38 / 19) < 1e-12


def test_root_p95_uses_nearest_rank(
    telemetry: Telemetry, span_exporter: InMemorySpanExporter
) -> None:
    gaps = tuple(float(ms) for ms in range(1, 21))  # 20 gaps: P95 by nearest rank is the 19th
    trace = ResponseTrace(telemetry, model="smol", api="realtime", response_id="r", session_id=None)
    trace.llm(time.time_ns(), _result(itl_ms=gaps, output_tokens=21))
    trace.finish(_finished(_result(itl_ms=gaps, output_tokens=21)))
    root = next(s for s in span_exporter.get_finished_spans() if s.name == "chat smol")
    assert root.attributes[ATTR.ITL_P95_MS] == 19.0


def test_single_token_and_failed_responses(
    telemetry: Telemetry, span_exporter: InMemorySpanExporter
) -> None:
    one = _result(output_tokens=1, decode_ms=6.0, itl_ms=())
    trace = ResponseTrace(
        telemetry, model="smol", api="realtime", response_id="r1", session_id=None
    )
    trace.llm(time.time_ns(), one)
    trace.finish(_finished(one))
    failed = ResponseTrace(
        telemetry, model="smol", api="realtime", response_id="r2", session_id=None
    )
    failed.finish(_finished(None))

    rows = samples(telemetry)
    tpot = "gen_ai_server_time_per_output_token_seconds"
    # decode_ms / max(output_tokens - 1, 1): one token still gives one TPOT observation
    assert value(rows, f"{tpot}_count", api="realtime") == 1
    assert value(rows, f"{tpot}_sum", api="realtime") == 0.006
    assert not [r for r in rows if r[0].startswith("visiongate_llm_inter_token_latency")]
    assert value(rows, "gen_ai_server_request_duration_seconds_count", status="failed") == 1
    roots = [s for s in span_exporter.get_finished_spans() if s.name == "chat smol"]
    assert len(roots) == 2 and all(ATTR.ITL_P95_MS not in (s.attributes or {}) for s in roots)
