"""A real Prometheus scrapes the scheduler metrics of a `Telemetry` and evaluates the scheduler
recording rules (ITL quantile and SLI, preemption rate, KV block usage) on them."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from gateway.engine.interface import EngineStats
from gateway.telemetry import Telemetry
from tests.deploy.conftest import prometheus_bin  # noqa: F401 - fixture
from tests.deploy.test_prometheus_live import (  # noqa: F401 - fixtures
    metrics_server,
    prometheus,
    query,
    wait_for,
)

ITL_P95 = "visiongate:visiongate_llm_inter_token_latency_seconds:p95_5m"


class Scheduler:
    def __init__(self) -> None:
        self.snapshot = EngineStats(
            running=6,
            waiting=1,
            batch_size=6,
            step_tokens=70,
            kv_blocks_used=48,
            kv_blocks_cached=8,
            kv_blocks_total=64,
        )

    def stats(self) -> EngineStats:
        return self.snapshot


def _stream(telemetry: Telemetry, gaps_s: list[float]) -> None:
    telemetry.metrics.record_response(
        model="smol",
        status="completed",
        ttft_s=0.2,
        duration_s=2.0,
        output_tokens=len(gaps_s) + 1,
        input_tokens=20,
        image_tokens=0,
        cached_tokens=0,
        time_per_output_token_s=sum(gaps_s) / len(gaps_s),
        api="realtime",
        inter_token_latencies_s=gaps_s,
    )


def _number(result: list[dict[str, Any]]) -> float:
    return float(result[0]["value"][1])


def test_scheduler_rules_on_real_prometheus(
    prometheus: str,
    metrics_server: tuple[Telemetry, int],
) -> None:
    telemetry, _ = metrics_server
    scheduler = Scheduler()
    telemetry.metrics.observe_gauges(
        active_sessions=lambda: 0,
        queue_depth=lambda: 0,
        cache_bytes=dict,
        engine_stats=scheduler.stats,
    )
    # One stream creates the series; rate() needs a scrape of it before the real traffic.
    _stream(telemetry, [0.02])
    wait_for(prometheus, "visiongate_llm_inter_token_latency_seconds_count", lambda r: True)
    wait_for(prometheus, "visiongate_scheduler_preemptions_total", lambda r: True)

    # 20 streams of 20 gaps: 90% in the 15-20 ms bucket, 10% stalled at 0.4 s (0.3-0.4 bucket)
    for _ in range(20):
        _stream(telemetry, [0.4 if i % 10 == 0 else 0.018 for i in range(20)])
    scheduler.snapshot = replace(scheduler.snapshot, preemptions_total=30)

    def settled(result: list[dict[str, Any]]) -> bool:
        return not math.isnan(_number(result)) and _number(result) > 0.25

    p95 = _number(wait_for(prometheus, ITL_P95, settled))
    assert 0.3 < p95 <= 0.4, p95
    p50 = _number(query(prometheus, ITL_P95.replace("p95", "p50")))
    assert 0.015 < p50 <= 0.02, p50
    over = _number(wait_for(prometheus, "visiongate:itl_slo:error_ratio_rate5m", lambda r: True))
    assert 0.09 < over < 0.11, over  # 40 of the 400 gaps after the first scrape are slow

    kv = wait_for(prometheus, "visiongate:kv_blocks_used:ratio", lambda r: True)
    assert _number(kv) == 0.75
    rate = wait_for(prometheus, "visiongate:scheduler_preemptions:rate5m", lambda r: _number(r) > 0)
    assert _number(rate) > 0
    running = query(prometheus, 'visiongate_scheduler_requests{state="running"}')
    assert _number(running) == 6
