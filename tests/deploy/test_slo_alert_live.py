"""The TTFT error-budget burn alert fires on a real Prometheus when the gateway gets slow, and
resolves once it is fast again.

Prometheus (Debian's) scrapes a real gateway's /metrics every half second and evaluates the
production rule files with every window and `for` scaled by 1/120 (`deploy.stack.scaled_rules`:
an hour lasts 30 s, five minutes 2.5 s; thresholds and expressions untouched). The gateway
runs over the fast suite's fake engine, with one knob added: a delay before the first token,
the latency regression. No model is loaded.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import stack
from gateway.testing.fake_gateway import FakeGateway, start_gateway, unit_settings
from gateway.testing.fakes import FakeEncoder, FakeEngine
from tests.deploy.conftest import PROMETHEUS_DIR

SCALE = 1 / 120
BURN = "VisiongateTTFTErrorBudgetBurn"
THRESHOLD = "VisiongateTTFTP95AboveSLO"
SLOW_S = 2.6  # over the 2 s objective, and past the le="2.5" bucket too


class SlowingEngine(FakeEngine):
    """The fake engine, plus `first_token_delay_s` spent before the first token."""

    first_token_delay_s = 0.0

    async def generate(self, request: Any) -> AsyncIterator[Any]:
        if self.first_token_delay_s:
            await asyncio.sleep(self.first_token_delay_s)
        async for delta in super().generate(request):
            yield delta


@pytest.fixture
def slowing_gateway() -> Iterator[FakeGateway]:
    gateway = start_gateway(
        unit_settings(engine_max_queue=64), SlowingEngine(), FakeEncoder(), wait=True
    )
    yield gateway
    gateway.server.stop()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        payload = json.load(resp)
    assert payload["status"] == "success", payload
    return payload["data"]


def alert_states(base: str) -> dict[str, str]:
    """alertname -> state (pending/firing) of every active alert on the real server."""
    return {a["labels"]["alertname"]: a["state"] for a in _get(f"{base}/api/v1/alerts")["alerts"]}


def _ratio(base: str) -> float | None:
    query = "visiongate:ttft_slo:error_ratio_rate5m"  # the 5m window, scaled to 2.5 s
    result = _get(f"{base}/api/v1/query?query={query}")["result"]
    return float(result[0]["value"][1]) if result else None


async def _until(what: str, check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(0.25)


async def _load(
    base_url: str, stop: asyncio.Event, concurrency: int, *, pause_s: float = 0.0
) -> int:
    """`concurrency` clients asking one question after another (`pause_s` between) until
    `stop`; returns how many were answered. The clients start spread over one slow answer, so
    answers keep arriving in every short window instead of in bursts."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    answered = 0

    async def one_client(i: int) -> None:
        nonlocal answered
        await asyncio.sleep(i * SLOW_S / concurrency)
        while not stop.is_set():
            out = await client.chat.completions.create(
                model="fake-echo",
                messages=[{"role": "user", "content": "How slow is it today?"}],
                max_tokens=3,
            )
            assert out.choices[0].message.content
            answered += 1
            await asyncio.sleep(pause_s)

    try:
        await asyncio.gather(*(one_client(i) for i in range(concurrency)))
    finally:
        await client.close()
    return answered


def test_scaled_rules_are_the_production_rules_with_short_windows(
    tmp_path: Path, promtool: str
) -> None:
    written = stack.scaled_rules(tmp_path, SCALE)
    assert [p.name for p in written] == sorted(
        p.name for p in (PROMETHEUS_DIR / "rules").glob("*.yml")
    )
    done = subprocess.run(
        [promtool, "check", "rules", *map(str, written)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for path in written:
        prod = yaml.safe_load((PROMETHEUS_DIR / "rules" / path.name).read_text())
        fast = yaml.safe_load(path.read_text())
        for group_p, group_f in zip(prod["groups"], fast["groups"], strict=True):
            for rp, rf in zip(group_p["rules"], group_f["rules"], strict=True):
                assert rp.get("alert") == rf.get("alert") and rp.get("record") == rf.get("record")
                assert rp.get("labels") == rf.get("labels")
                if "[1h]" in rp["expr"]:
                    assert "[30000ms]" in rf["expr"] and "[1h]" not in rf["expr"]
                if rp.get("for") == "2m":
                    assert rf["for"] == "1000ms"


async def test_ttft_burn_rate_alert_fires_on_a_slowdown_and_resolves(
    slowing_gateway: FakeGateway, prometheus_bin: str, tmp_path: Path
) -> None:
    engine = slowing_gateway.engine
    assert isinstance(engine, SlowingEngine)
    port = slowing_gateway.server.port
    prom = stack.prometheus(
        stack.free_port(),
        f"127.0.0.1:{port}",
        tmp_path,
        rule_files=stack.scaled_rules(tmp_path / "rules", SCALE),
        interval="500ms",
    )
    base_url = f"{slowing_gateway.http_url}/v1"
    prom.start()
    try:
        prom.wait_ready()
        base = f"http://127.0.0.1:{prom.ports['http']}"
        # healthy traffic first, a few answers a second: the TTFT series exist, nothing is wrong
        stop = asyncio.Event()
        load = asyncio.ensure_future(_load(base_url, stop, concurrency=1, pause_s=0.5))
        await _until(
            "the gateway's TTFT series scraped",
            lambda: _get(
                f"{base}/api/v1/query?query=gen_ai_server_time_to_first_token_seconds_count"
            )["result"],
            15,
        )
        await asyncio.sleep(2)
        assert BURN not in alert_states(base)
        stop.set()
        assert await load > 0

        # the regression: every first token now takes longer than the objective
        engine.first_token_delay_s = SLOW_S
        stop = asyncio.Event()
        load = asyncio.ensure_future(_load(base_url, stop, concurrency=16))
        await _until("the burn alert firing", lambda: alert_states(base).get(BURN) == "firing", 40)
        assert alert_states(base).get(THRESHOLD) in ("pending", "firing")
        stop.set()
        slow_answers = await load
        assert slow_answers > 0

        # fast again: the short windows see only good responses and the alert resolves
        engine.first_token_delay_s = 0.0
        stop = asyncio.Event()
        load = asyncio.ensure_future(_load(base_url, stop, concurrency=1, pause_s=0.2))
        await _until("the burn alert resolved", lambda: BURN not in alert_states(base), 20)
        await _until("the short-window error ratio back to 0", lambda: _ratio(base) == 0.0, 10)
        stop.set()
        await load
    finally:
        prom.stop()
