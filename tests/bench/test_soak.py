"""The soak benchmark: its per-key numbers and report pieces (fast), and one short run on the
fake engine and encoder, checked against the turns it recorded."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bench._load_stats import TurnRecord, percentile
from bench._soak_report import (
    code_counts,
    key_summary,
    key_table,
    parse_error_counter,
    parse_gauges,
    per_key_rows,
    read_rss,
    rss_summary,
    rss_text,
)
from bench.soak import parse_args

ROOT = Path(__file__).resolve().parents[2]


def _turn(
    ttft: float | None, *, turn: int = 1, status: str = "ok", code: str | None = None
) -> TurnRecord:
    return TurnRecord(
        session=0, turn=turn, sent_s=1.0, status=status, ttft_ms=ttft, error_code=code
    )


def test_key_summary_pools_both_transports_and_counts_lost_turns() -> None:
    ws = [_turn(float(v), turn=i % 3) for i, v in enumerate(range(100, 200, 10))]  # 100..190
    http = [
        _turn(400.0, turn=0),
        _turn(None, status="error", code="busy"),
        _turn(None, status="abandoned", code="turn_timeout"),
    ]
    s = key_summary(ws, http)
    assert (s["turns"], s["turns_attempted"], s["failed"]) == (11, 13, 2)
    all_ok = [*range(100, 200, 10), 400]
    assert s["ttft_p95_ms"] == pytest.approx(percentile(all_ok, 95))
    assert s["ttft_p50_ms"] == pytest.approx(150.0)
    assert s["ttft_ws_p95_ms"] == pytest.approx(percentile(range(100, 200, 10), 95))
    assert s["ttft_http_p95_ms"] == 400.0
    assert s["lost_p95_ms"] == math.inf  # 2 of 13 lost: past the 95th percentile
    assert s["error_codes"] == {"busy": 1, "turn_timeout": 1}
    assert (s["turns_ws"], s["turns_http"]) == (10, 1)
    assert s["ttft_first_p95_ms"] == pytest.approx(percentile([100, 130, 160, 190, 400], 95))


def test_per_key_rows_ratio_and_goal() -> None:
    def summary(p95: float | None, failed: int = 0) -> dict:
        return {"ttft_p95_ms": p95, "turns": 10, "failed": failed}

    summaries = {
        "baseline": {
            "a": summary(100.0),
            "b": summary(100.0),
            "c": summary(100.0),
            "d": summary(None),
        },
        "abuse": {
            "a": summary(150.0),
            "b": summary(250.0),
            "c": summary(120.0, 1),
            "d": summary(50.0),
        },
    }
    rows = {r["key"]: r for r in per_key_rows(summaries, ["a", "b", "c", "d", "e"])}
    assert rows["a"]["ratio"] == pytest.approx(1.5) and rows["a"]["within_goal"]
    assert rows["b"]["ratio"] == pytest.approx(2.5) and not rows["b"]["within_goal"]
    assert rows["c"]["ratio"] == pytest.approx(1.2) and not rows["c"]["within_goal"]  # a failure
    assert rows["d"]["ratio"] is None and not rows["d"]["within_goal"]  # nothing to compare
    assert rows["e"]["baseline_turns"] == 0 and rows["e"]["ratio"] is None
    assert not any(r["starved"] for r in rows.values())
    starved = per_key_rows(
        {
            "baseline": {"a": summary(100.0)},
            "abuse": {"a": {"ttft_p95_ms": None, "turns": 0, "failed": 2}},
        },
        ["a"],
    )
    assert starved[0]["starved"] and not starved[0]["within_goal"]
    assert "starved" in key_table(starved)
    table = key_table(list(rows.values()))
    assert "1.50x" in table and "2.50x" in table and table.count("NOT met") == 4


def test_error_counts_rss_and_the_gateways_counter() -> None:
    records = [
        _turn(10.0),
        _turn(None, status="error", code="busy"),
        _turn(None, status="error", code="busy"),
        _turn(None, status="abandoned"),
    ]
    assert code_counts(records) == Counter({"busy": 2, "abandoned": 1})
    text = (
        "# TYPE visiongate_errors_total counter\n"
        'visiongate_errors_total{api="http",code="input_too_large",job="x"} 3.0\n'
        'visiongate_errors_total{api="realtime",code="input_too_large"} 2.0\n'
        'visiongate_errors_total{api="http",code="invalid_image"} 1.0\n'
        'visiongate_responses_total{code="ignored"} 9.0\n'
    )
    assert parse_error_counter(text) == {"input_too_large": 5.0, "invalid_image": 1.0}
    gauges = parse_gauges(
        text + 'visiongate_scheduler_requests{state="waiting"} 4.0\n'
        "visiongate_scheduler_batch_size 3.0\n# HELP visiongate_kv_blocks x\n"
    )
    assert gauges == {
        'visiongate_scheduler_requests{state="waiting"}': 4.0,
        "visiongate_scheduler_batch_size": 3.0,
    }
    rss = read_rss(os.getpid())
    assert rss is not None and rss > 10 * 2**20
    assert read_rss(2**31 - 1) is None  # no such process
    samples = [
        {"t_s": t, "phase": p, "rss_bytes": b}
        for t, p, b in (
            (0.0, "baseline", 100),
            (1.0, "baseline", 130),
            (2.0, "abuse", 120),
            (3.0, "abuse", 200),
            (4.0, "abuse", 180),
        )
    ]
    by_phase = rss_summary(samples)
    assert by_phase["abuse"] == {
        "samples": 3,
        "first_bytes": 120,
        "peak_bytes": 200,
        "last_bytes": 180,
        "growth_bytes": 60,
    }
    assert rss_text(samples, every_s=2.0).startswith("RSS MiB: 0s 0, 2s 0, 4s 0")


def test_arguments() -> None:
    fake = parse_args(["--fake"])
    assert (fake.warmup_s, fake.drain_s, fake.duration) == (1.0, 3.0, 60.0)
    real = parse_args(["--duration", "30", "--gateway-setting", "Rate_Limit_Per_Minute=30"])
    assert (real.warmup_s, real.drain_s, real.duration) == (10.0, 15.0, 30.0)
    assert real.gateway_setting == [("rate_limit_per_minute", "30")]
    assert real.abuse == [
        "long_prompts",
        "oversize",
        "bad_images",
        "slow_readers",
        "bursts",
        "slow_clients",
    ]
    assert (real.burst_size, real.burst_every_s, real.slow_clients) == (32, 3.0, 150)
    assert parse_args(["--abuse", "oversize, slow_readers"]).abuse == ["oversize", "slow_readers"]
    for bad in (
        ["--duration", "0"],
        ["--good-keys", "0"],
        ["--gateway-setting", "novalue"],
        ["--abuse", "oversize,ddos"],
        ["--burst-every-s", "0"],
        ["--slow-clients", "-1"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_short_run_on_the_fakes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.soak",
            "--fake",
            "--duration",
            "3",
            "--good-keys",
            "2",
            "--bad-keys",
            "1",
            "--abuse-concurrency",
            "2",
            "--slow-readers",
            "1",
            "--long-max-tokens",
            "32",
            "--burst-size",
            "2",
            "--burst-every-s",
            "1",
            "--slow-clients",
            "12",
            "--gateway-setting",
            "header_timeout_s=0.5",
            "--gateway-setting",
            "body_timeout_s=0.5",
            "--warmup-s",
            "0.5",
            "--drain-s",
            "2",
            "--progress-s",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "good-1" in proc.stdout and "ratio" in proc.stdout and "RSS MiB" in proc.stdout
    assert "phase=abuse" in proc.stderr and "progress" in proc.stderr  # structlog progress
    text = (out / "soak.json").read_text()
    assert "sk-soak-" not in text and "sk-soak-" not in proc.stdout + proc.stderr  # no key leaks
    report = json.loads(text)
    assert report["status"] == "complete" and report["engine"].startswith("fake")
    assert report["keys"] == {"well_behaved": ["good-1", "good-2"], "abusive": ["abusive-1"]}
    assert (out / "soak.png").stat().st_size > 10_000

    phases = report["phases"]
    base_window, abuse_window = phases["baseline"]["window_s"], phases["abuse"]["window_s"]
    assert base_window[1] <= abuse_window[0]
    rows = {r["key"]: r for r in report["per_key"]}
    assert set(rows) == {"good-1", "good-2"}
    for phase, window in (("baseline", base_window), ("abuse", abuse_window)):
        turns = phases[phase]["turns"]
        assert {t["transport"] for t in turns} == {"ws", "http"}
        assert all(window[0] <= t["sent_s"] <= window[1] for t in turns)
        for key in rows:
            mine = [t["ttft_ms"] for t in turns if t["key"] == key and t["status"] == "ok"]
            assert mine, (phase, key)
            # the published P95 is the one of this key's recorded turns
            expected = percentile(mine, 95)
            assert phases[phase]["keys"][key]["ttft_p95_ms"] == pytest.approx(expected, abs=0.01)
            assert rows[key][f"{phase}_p95_ms"] == pytest.approx(expected, abs=0.01)
            assert rows[key][f"{phase}_turns"] == len(mine)
        failed = Counter(t["error_code"] or t["status"] for t in turns if t["status"] != "ok")
        assert report["errors_by_code"][phase]["well_behaved"] == dict(failed)
    for key, row in rows.items():
        # soak.json keeps 3 decimals of each number
        assert row["ratio"] == pytest.approx(
            row["abuse_p95_ms"] / row["baseline_p95_ms"], rel=1e-2, abs=2e-3
        ), key
    assert report["goal"]["met"] == all(r["within_goal"] for r in rows.values())
    assert not phases["baseline"]["abuse_outcomes"]  # the baseline is the good keys alone

    # the abusers ran, and the gateway refused their oversize requests with the stable codes
    outcomes = phases["abuse"]["abuse_outcomes"]["abusive-1"]
    assert outcomes["long_prompts"].get("ok", 0) > 0
    assert set(outcomes["oversize"]) <= {"input_too_large", "image_too_large"}
    assert outcomes["oversize"].get("input_too_large", 0) > 0
    # bursts went out whole; the slow connections were cut off with 408 and came back
    assert sum(outcomes["bursts"].values()) >= 2
    assert outcomes["slow_clients"].get("closed:408", 0) > 12
    assert outcomes["slow_readers"].get("connected", 0) >= 1
    client = report["errors_by_code"]["abuse"]["abusive"]
    server = phases["abuse"]["server_errors_by_code"]
    # (the gateway's own count may hold internal_error from clients that left at the phase's
    # end: tests/gateway/api/test_fuzz.py::test_send_to_a_client_gone_is_quiet)
    assert "internal_error" not in client
    for code, n in client.items():  # every refusal the clients saw, the gateway counted
        if not code.startswith(
            ("connection:", "connect:", "dropped:", "send_blocked", "timeout", "closed:")
        ):  # (connections closed by the server's guard are counted in their own series)
            assert server.get(code, 0) >= n, (code, client, server)

    gauges = report["gateway_gauges"]  # the scheduler's series, read at each progress line
    assert {"baseline", "abuse"} <= {g["phase"] for g in gauges}
    assert all("visiongate_scheduler_batch_size" in g["values"] for g in gauges)

    samples = report["rss"]["samples"]
    assert len(samples) >= 6 and all(s["rss_bytes"] > 10 * 2**20 for s in samples)
    assert [s["t_s"] for s in samples] == sorted(s["t_s"] for s in samples)
    assert {"baseline", "abuse"} <= {s["phase"] for s in samples}
    assert report["rss"]["by_phase"]["abuse"]["peak_bytes"] == max(
        s["rss_bytes"] for s in samples if s["phase"] == "abuse"
    )
