"""A real Prometheus scrapes a `Telemetry`'s /metrics text and evaluates the SLO recording rules.

The metrics server here serves exactly what the gateway's /metrics route serves
(`Telemetry.prometheus_text()`); Prometheus scrapes and evaluates every second.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gateway.telemetry import Telemetry, config_from_env
from tests.conftest import free_port, wait_for_port
from tests.deploy.conftest import PROMETHEUS_DIR

P95 = "visiongate:gen_ai_server_time_to_first_token_seconds:p95_5m"


@pytest.fixture
def metrics_server() -> Iterator[tuple[Telemetry, int]]:
    telemetry = Telemetry(config_from_env({}), "0.0.0-test", "live-test")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body, content_type = telemetry.prometheus_text()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield telemetry, int(server.server_address[1])
    server.shutdown()
    server.server_close()
    telemetry.shutdown()


@pytest.fixture
def prometheus(
    prometheus_bin: str, metrics_server: tuple[Telemetry, int], tmp_path: Path
) -> Iterator[str]:
    _, target_port = metrics_server
    with run_prometheus(prometheus_bin, f"127.0.0.1:{target_port}", tmp_path) as base:
        yield base


@contextlib.contextmanager
def run_prometheus(prometheus_bin: str, target: str, tmp_path: Path) -> Iterator[str]:
    """Debian's prometheus scraping `target` every second with the SLO rules loaded; yields
    its base URL."""
    rules = sorted(str(p) for p in (PROMETHEUS_DIR / "rules").glob("*.yml"))
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": rules,
                "scrape_configs": [
                    {
                        "job_name": "visiongate-gateway",
                        "static_configs": [{"targets": [target]}],
                    }
                ],
            }
        )
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            prometheus_bin,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_port(port, timeout=15)
        base = f"http://127.0.0.1:{port}"
        _wait_ready(base, proc)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()


def _wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """Prometheus opens its port before the TSDB is loaded; /-/ready says when it serves."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "prometheus exited during startup"
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"prometheus at {base} not ready after {timeout}s")


def query(base: str, promql: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as resp:
        payload = json.load(resp)
    assert payload["status"] == "success", payload
    return payload["data"]["result"]


def wait_for(base: str, promql: str, ok: Any, timeout: float = 15.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    result: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        result = query(base, promql)
        if result and ok(result):
            return result
        time.sleep(0.25)
    raise AssertionError(f"{promql}: no acceptable result within {timeout}s, last {result}")


def record_ttft(telemetry: Telemetry, ttft_s: float) -> None:
    telemetry.metrics.record_response(
        model="smol",
        status="completed",
        ttft_s=ttft_s,
        duration_s=ttft_s + 1.0,
        output_tokens=10,
        input_tokens=20,
        image_tokens=64,
        cached_tokens=0,
        time_per_output_token_s=0.02,
        api="realtime",
    )


def test_p95_ttft_recording_rule_on_real_prometheus(
    prometheus: str, metrics_server: tuple[Telemetry, int]
) -> None:
    telemetry, _ = metrics_server
    # One observation creates the series; rate() needs a scrape of it before the real traffic.
    record_ttft(telemetry, 0.25)
    wait_for(prometheus, "gen_ai_server_time_to_first_token_seconds_count", lambda r: True)

    # 90% fast (0.2-0.3 s bucket) and 10% slow (1.5-2.0 s bucket): the P95 is in the slow bucket.
    for i in range(200):
        record_ttft(telemetry, 1.8 if i % 10 == 0 else 0.25)

    def settled(result: list[dict[str, Any]]) -> bool:
        value = float(result[0]["value"][1])
        return not math.isnan(value) and value > 0.3

    def p50_settled(result: list[dict[str, Any]]) -> bool:
        return 0.2 < float(result[0]["value"][1]) <= 0.3

    p95 = float(wait_for(prometheus, P95, settled)[0]["value"][1])
    assert 1.5 < p95 <= 2.0, p95

    # The P50 rule may sit in another group, evaluated on its own tick: wait for it the same way.
    p50 = float(wait_for(prometheus, P95.replace("p95", "p50"), p50_settled)[0]["value"][1])
    assert 0.2 < p50 <= 0.3, p50
    # Every TTFT is under the 2 s objective: the SLI error ratio is zero.
    ratio = wait_for(prometheus, "visiongate:ttft_slo:error_ratio_rate5m", lambda r: True)
    assert float(ratio[0]["value"][1]) == pytest.approx(0.0, abs=1e-9)
