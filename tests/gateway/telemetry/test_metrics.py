"""GatewayMetrics -> Prometheus text: names, labels, counts and bucket boundaries."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.engine.interface import EngineStats
from gateway.telemetry import PROMETHEUS_NAMES, GatewayMetrics, Telemetry, config_from_env

# what a scheduler reports mid-run: 40 + 24 of 128 blocks taken or cached, 64 empty
SCHEDULER = EngineStats(
    running=3,
    waiting=2,
    batch_size=3,
    step_tokens=258,
    kv_blocks_used=40,
    kv_blocks_total=128,
    kv_blocks_cached=24,
    preemptions_total=7,
)


def record_one_of_each(m: GatewayMetrics) -> None:
    m.record_response(
        model="smol",
        status="completed",
        ttft_s=0.42,
        duration_s=1.7,
        output_tokens=12,
        input_tokens=30,
        image_tokens=64,
        cached_tokens=20,
        time_per_output_token_s=0.02,
        api="realtime",
        inter_token_latencies_s=[0.008, 0.02, 0.02, 0.3],
    )
    m.record_encode(
        timings_ms={"preprocess": 4.0, "vision": 80.0, "prune": 1.5, "quantize": 0.8},
        batch_size=3,
        queue_ms=12.0,
        tokens_kept=98,
        tokens_total=196,
    )
    m.record_cache_lookup(cache="vision", tier="memory", result="hit")
    m.record_kv_reuse(reused_tokens=40, prefill_tokens=10)
    m.record_kv_warmup(outcome="warmed", computed_tokens=120)
    m.record_visual_budget(keep_ratio_cap=0.3)
    m.record_error(code="image_too_large", api="chat_completions")
    m.record_key_usage(
        key="key_0123456789abcdef01234567",
        input_tokens=30,
        cached_tokens=20,
        output_tokens=12,
        image_tokens=64,
        encode_s=0.08,
    )
    m.record_key_refusal(key="key_0123456789abcdef01234567", limit="tokens")
    m.ws_connection_opened()
    m.observe_gauges(
        active_sessions=lambda: 2,
        queue_depth=lambda: 5,
        cache_bytes=lambda: {"vision": 1024},
        engine_stats=lambda: SCHEDULER,
    )
    m.record_upstream_attempt(upstream="10.0.0.1:8000", outcome="ok", ttft_s=0.12)
    m.record_connection_refusal("header_timeout")
    m.observe_upstreams(
        in_flight=lambda: {"10.0.0.1:8000": 2}, healthy=lambda: {"10.0.0.1:8000": True}
    )


def samples(t: Telemetry) -> list[tuple[str, dict[str, str], float]]:
    body, content_type = t.prometheus_text()
    assert content_type.startswith("text/plain")
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    ]


def value(rows: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    found = [
        v for n, lab, v in rows if n == name and all(lab.get(k) == x for k, x in labels.items())
    ]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_every_metric_has_its_documented_prometheus_name(telemetry: Telemetry) -> None:
    record_one_of_each(telemetry.metrics)
    names = {n for n, _, _ in samples(telemetry)}
    for otel_name, prom in PROMETHEUS_NAMES.items():
        assert prom in names or f"{prom}_bucket" in names, (otel_name, prom, sorted(names))


def test_values_and_labels(telemetry: Telemetry) -> None:
    m = telemetry.metrics
    record_one_of_each(m)
    m.record_response(
        model="smol",
        status="cancelled",
        ttft_s=None,
        duration_s=0.2,
        output_tokens=0,
        input_tokens=5,
        image_tokens=0,
        cached_tokens=0,
        time_per_output_token_s=None,
        api="chat_completions",
    )
    m.record_cache_lookup(cache="vision", tier="redis", result="miss")
    m.ws_connection_opened()
    m.ws_connection_closed()
    rows = samples(telemetry)

    ttft = "gen_ai_server_time_to_first_token_seconds"
    assert value(rows, f"{ttft}_count", gen_ai_request_model="smol", api="realtime") == 1
    assert value(rows, f"{ttft}_sum", api="realtime") == 0.42
    assert value(rows, f"{ttft}_bucket", api="realtime", le="0.4") == 0
    assert value(rows, f"{ttft}_bucket", api="realtime", le="0.5") == 1
    assert not [r for r in rows if r[0] == f"{ttft}_count" and r[1]["api"] == "chat_completions"]
    les = [lab["le"] for n, lab, _ in rows if n == f"{ttft}_bucket"]
    assert les[0] == "0.05" and "2.0" in les and les[-2:] == ["30.0", "+Inf"]

    dur = "gen_ai_server_request_duration_seconds_count"
    assert value(rows, dur, status="completed", api="realtime") == 1
    assert value(rows, dur, status="cancelled", api="chat_completions") == 1
    assert value(rows, "visiongate_responses_total", status="completed", api="realtime") == 1
    assert value(rows, "visiongate_tokens_total", type="input") == 35
    assert value(rows, "visiongate_tokens_total", type="image") == 64
    assert value(rows, "visiongate_tokens_total", type="cached") == 20
    assert value(rows, "visiongate_visual_tokens_total", kind="kept") == 98
    assert value(rows, "visiongate_visual_tokens_total", kind="dropped") == 98
    stage = "visiongate_encode_stage_duration_seconds"
    assert value(rows, f"{stage}_sum", stage="vision") == 0.08
    assert value(rows, f"{stage}_bucket", stage="vision", le="0.1") == 1
    assert value(rows, f"{stage}_bucket", stage="preprocess", le="0.001") == 0
    assert value(rows, "visiongate_encode_queue_duration_seconds_sum") == 0.012
    assert value(rows, "visiongate_encode_batch_size_sum") == 3
    lookups = "visiongate_cache_lookups_total"
    assert value(rows, lookups, cache="vision", tier="memory", result="hit") == 1
    assert value(rows, lookups, cache="vision", tier="redis", result="miss") == 1
    assert value(rows, "visiongate_kv_reused_tokens_total") == 40
    assert value(rows, "visiongate_kv_prefill_tokens_total") == 10
    assert value(rows, "visiongate_errors_total", code="image_too_large") == 1
    assert value(rows, "visiongate_websocket_connections") == 1
    assert value(rows, "visiongate_sessions_active") == 2
    assert value(rows, "visiongate_encode_queue_depth") == 5
    assert value(rows, "visiongate_cache_bytes", cache="vision") == 1024

    itl = "visiongate_llm_inter_token_latency_seconds"
    assert value(rows, f"{itl}_count", gen_ai_request_model="smol", api="realtime") == 4
    assert abs(value(rows, f"{itl}_sum", api="realtime") - 0.348) < 1e-9
    assert value(rows, f"{itl}_bucket", api="realtime", le="0.005") == 0
    assert value(rows, f"{itl}_bucket", api="realtime", le="0.01") == 1
    assert value(rows, f"{itl}_bucket", api="realtime", le="0.02") == 3
    assert value(rows, f"{itl}_bucket", api="realtime", le="0.25") == 3
    assert value(rows, f"{itl}_bucket", api="realtime", le="0.3") == 4
    itl_les = [lab["le"] for n, lab, _ in rows if n == f"{itl}_bucket"]
    assert itl_les[0] == "0.005" and itl_les[-2:] == ["2.0", "+Inf"]
    assert not [r for r in rows if r[0] == f"{itl}_count" and r[1]["api"] == "chat_completions"]
    tpot = "gen_ai_server_time_per_output_token_seconds"
    assert value(rows, f"{tpot}_sum", api="realtime") == 0.02
    assert value(rows, "visiongate_scheduler_requests", state="running") == 3
    assert value(rows, "visiongate_scheduler_requests", state="waiting") == 2
    assert value(rows, "visiongate_scheduler_batch_size") == 3
    assert value(rows, "visiongate_scheduler_step_tokens") == 258
    assert value(rows, "visiongate_kv_blocks", state="used") == 40
    assert value(rows, "visiongate_kv_blocks", state="cached") == 24
    assert value(rows, "visiongate_kv_blocks", state="free") == 64
    assert value(rows, "visiongate_scheduler_preemptions_total") == 7
    info = value(
        rows, "target_info", service_name="visiongate", service_instance_id="test-instance"
    )
    assert info == 1


def test_two_instances_do_not_share_metrics() -> None:
    a = Telemetry(config_from_env({}), "1", "a")
    b = Telemetry(config_from_env({}), "1", "b")
    try:
        a.metrics.record_error(code="x", api="realtime")
        a.metrics.record_error(code="x", api="realtime")
        b.metrics.record_error(code="x", api="realtime")
        assert value(samples(a), "visiongate_errors_total", code="x") == 2
        assert value(samples(b), "visiongate_errors_total", code="x") == 1
    finally:
        a.shutdown()
        b.shutdown()


def test_observe_gauges_only_once(telemetry: Telemetry) -> None:
    m = telemetry.metrics
    m.observe_gauges(active_sessions=lambda: 0, queue_depth=lambda: 0, cache_bytes=dict)
    try:
        m.observe_gauges(active_sessions=lambda: 0, queue_depth=lambda: 0, cache_bytes=dict)
    except RuntimeError as exc:
        assert "already" in str(exc)
    else:
        raise AssertionError("second observe_gauges() was accepted")
