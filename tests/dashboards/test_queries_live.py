"""Every dashboard query returns data from a real Prometheus holding the gateway's series.

No Grafana server can run here, so the panels are checked where their data comes from:
Debian's prometheus scrapes, every second, the /metrics text of a gateway `Telemetry` that keeps
recording one of each of its measurements (every series the gateway exports, the scheduler's
and the upstream replicas' included), and each panel's query (Grafana's variables substituted
as Grafana would: `$__rate_interval` by a few scrape intervals, `$model` by all) must answer
with at least one series.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from dashboards import build_all
from gateway.telemetry import Telemetry
from tests.deploy.test_prometheus_live import metrics_server, query, run_prometheus  # noqa: F401
from tests.gateway.telemetry.test_metrics import record_one_of_each

RATE_INTERVAL = "6s"  # Grafana: at least four scrape intervals


def _panel_queries() -> list[tuple[str, str]]:
    out = []
    for name, doc in build_all().items():
        if name == "alert-rules.json":
            continue
        for panel in doc["panels"]:
            for p in [panel, *panel.get("panels", [])]:
                for t in p.get("targets", []):
                    expr = t["expr"].replace("$__rate_interval", RATE_INTERVAL)
                    out.append((f"{doc['uid']} / {p['title']}", expr.replace("$model", ".*")))
    return out


def test_every_panel_query_returns_data(
    prometheus_bin: str,
    metrics_server: tuple[Telemetry, int],
    tmp_path: Path,
) -> None:
    telemetry, port = metrics_server
    queries = _panel_queries()
    assert len(queries) > 40
    stop = threading.Event()

    metrics = telemetry.metrics
    record_one_of_each(metrics)  # every series once, the observed gauges included

    def keep_recording() -> None:
        """A short load: responses, encodes, lookups of both caches, replica attempts."""
        while not stop.is_set():
            metrics.record_response(
                model="smol",
                status="completed",
                ttft_s=0.3,
                duration_s=1.2,
                output_tokens=8,
                input_tokens=24,
                image_tokens=64,
                cached_tokens=16,
                time_per_output_token_s=0.03,
                api="realtime",
                inter_token_latencies_s=[0.02, 0.03],
            )
            metrics.record_encode(
                timings_ms={"preprocess": 3.0, "vision": 60.0, "prune": 1.0, "quantize": 0.5},
                batch_size=2,
                queue_ms=8.0,
                tokens_kept=90,
                tokens_total=196,
            )
            metrics.record_cache_lookup(cache="vision", tier="redis", result="hit")
            metrics.record_cache_lookup(cache="kv", tier="memory", result="hit")
            metrics.record_cache_lookup(cache="kv", tier="none", result="miss")
            metrics.record_kv_reuse(reused_tokens=32, prefill_tokens=8)
            metrics.record_upstream_attempt(upstream="10.0.0.1:8000", outcome="ok", ttft_s=0.1)
            stop.wait(0.25)

    recorder = threading.Thread(target=keep_recording, daemon=True)
    recorder.start()
    try:
        with run_prometheus(prometheus_bin, f"127.0.0.1:{port}", tmp_path) as base:
            empty: list[str] = []
            deadline = time.monotonic() + 30
            while True:
                empty = [title for title, expr in queries if not query(base, expr)]
                if not empty or time.monotonic() > deadline:
                    break
                time.sleep(1)
    finally:
        stop.set()
        recorder.join(timeout=5)
    assert not empty, f"panels whose query returned nothing: {empty}"
