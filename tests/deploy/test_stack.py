"""`python -m deploy.stack` (what `make stack` runs): it starts every part, says where each
listens, carries a chat's spans to the Kafka topic and the gateway's metrics to Prometheus, and
leaves nothing running after Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from deploy.stack import ROOT, TOPIC
from tests.deploy.kafka_topic import TopicSpans

pytestmark = pytest.mark.slow

PARTS = ("gateway", "collector", "kafka", "prometheus")


def _read_until_ready(proc: subprocess.Popen[str], timeout_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"the stack exited ({proc.wait()}) before it was ready: {lines}")
        lines.append(line.rstrip("\n"))
        if line.startswith("ready"):
            return lines
    pytest.fail(f"the stack not ready within {timeout_s}s: {lines}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_stack_serves_traces_and_metrics_and_stops_everything_on_ctrl_c(
    tmp_path: Path, prometheus_bin: str
) -> None:
    from openai import OpenAI

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "ROTEL_"))}
    argv = [sys.executable, "-m", "deploy.stack", "--log-dir", str(tmp_path)]
    for flag in ("--port", "--kafka-port", "--otlp-grpc-port", "--otlp-http-port"):
        argv += [flag, "0"]
    argv += ["--prometheus-port", "0"]
    if cache_dir := os.environ.get("VISIONGATE_CACHE_DIR"):  # where the model is kept
        argv += ["--", "--cache-dir", cache_dir]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    pids: dict[str, int] = {}
    try:
        lines = _read_until_ready(proc, timeout_s=300)
        where = {line.split()[0]: line for line in lines if line.split()[:1] != []}
        for part in PARTS:
            pids[part] = int(re.search(r"pid (\d+)", where[part]).group(1))
        gateway = re.search(r"http://(127\.0\.0\.1:\d+)", where["gateway"]).group(1)
        kafka = re.search(r"(127\.0\.0\.1:\d+)", where["kafka"]).group(1)
        prometheus = re.search(r"http://(127\.0\.0\.1:\d+)", where["prometheus"]).group(1)
        assert TOPIC in where["kafka"]

        with OpenAI(base_url=f"http://{gateway}/v1", api_key="unused") as client:
            raw = client.chat.completions.with_raw_response.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=3,
            )
            request_id = raw.headers["x-request-id"]
            assert raw.parse().choices[0].message.content
        with TopicSpans(kafka) as topic:
            spans = topic.wait_for(
                lambda spans: any(
                    s.attributes.get("visiongate.request_id") == request_id for s in spans
                )
            )
        assert {"llm.prefill", "llm.decode"} <= {s.name for s in spans}

        query = urllib.parse.urlencode({"query": 'up{job="visiongate-gateway"}'})
        deadline = time.monotonic() + 40  # the production scrape interval is 15 s
        while True:
            with urllib.request.urlopen(f"http://{prometheus}/api/v1/query?{query}") as resp:
                result = json.load(resp)["data"]["result"]
            if result and result[0]["value"][1] == "1":
                break
            assert time.monotonic() < deadline, result
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert "stopped" in rest
    assert pids and not [part for part, pid in pids.items() if _alive(pid)]
