"""The upstream benchmark: its summaries and table (fast), and one tiny run over real replicas
and a real front gateway in child processes, checked against what it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.upstream import parse_args, summarize_overhead, summarize_routing, table

ROOT = Path(__file__).resolve().parents[2]


def _row(ttft: float | None, cached: int = 100, replica: int = 0, turn: int = 0) -> dict:
    return {
        "ttft_ms": ttft,
        "total_ms": (ttft or 0.0) + 50.0,
        "text": "hi",
        "prompt_tokens": 120,
        "cached_tokens": cached,
        "replica": replica,
        "turn": turn,
        "server_ttft_ms": (ttft or 0.0) - 5.0,
        "server_prefill_ms": (ttft or 0.0) - 7.0,
    }


def test_arguments_and_their_limits(tmp_path: Path) -> None:
    args = parse_args(["--out", str(tmp_path)])
    assert (args.requests, args.turns, args.conversations) == (30, 3, 6)
    for bad in (["--requests", "1"], ["--turns", "1"], ["--conversations", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--out", str(tmp_path), *bad])


def test_overhead_is_front_minus_direct_and_paired() -> None:
    direct = [_row(v) for v in (100.0, 110.0, 120.0, 200.0)]
    front = [_row(v, replica=1) for v in (103.0, 112.0, 124.0, 203.0)]
    out = summarize_overhead({"direct": direct, "front": front})
    assert out["direct"]["p50_ms"] == 115.0 and out["front"]["p50_ms"] == 118.0
    assert out["added_p50_ms"] == 3.0
    assert out["added_paired_median_ms"] == 3.0  # the pairs: 3, 2, 4, 3
    assert out["within_goal"] and out["goal_p50_ms"] == 5.0
    assert out["front_own_ms"]["p50_ms"] == 2.0  # its TTFT less the replica's, as it saw them
    assert out["replicas_used"] == [1]
    slower = [_row(r["ttft_ms"] + 9.0) for r in direct]
    slow = summarize_overhead({"direct": direct, "front": slower})
    assert not slow["within_goal"]


def test_routing_ratio_counts_follow_ups_only() -> None:
    def conv(first: float, *follow: float, replicas: tuple[int, ...]) -> list[dict]:
        rows = [_row(first, cached=0, replica=replicas[0])]
        for i, (v, r) in enumerate(zip(follow, replicas[1:], strict=True)):
            rows.append(_row(v, replica=r, turn=i + 1))
        return rows

    out = summarize_routing(
        {
            "affinity": [conv(900.0, 100.0, 100.0, replicas=(0, 0, 0))],
            "random": [conv(900.0, 100.0, 700.0, replicas=(0, 0, 1))],
        }
    )
    assert out["affinity"]["followup"]["mean_ms"] == 100.0
    assert out["random"]["followup"]["mean_ms"] == 400.0
    assert out["ratio_mean"] == 0.25 and out["within_goal"]
    assert out["affinity"]["replicas_per_conversation"] == [1]
    assert out["random"]["replicas_per_conversation"] == [2]
    assert out["affinity"]["first_turn"]["mean_ms"] == 900.0
    assert "random" in out["random_mode"]
    text = table(
        {
            "overhead": summarize_overhead(
                {"direct": [_row(100.0)] * 2, "front": [_row(102.0)] * 2}
            ),
            "routing": out,
        }
    )
    assert "added at P50 (median of paired differences): 2.0 ms" in text
    assert "0.25x of the means" in text


@pytest.mark.slow
def test_tiny_run_writes_json_and_table(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.upstream",
            "--out",
            str(tmp_path),
            "--requests",
            "3",
            "--turns",
            "2",
            "--conversations",
            "2",
            "--max-tokens",
            "4",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(a) measuring" in proc.stdout and "(b) 2 conversations" in proc.stdout  # progress
    report = json.loads((tmp_path / "upstream.json").read_text())
    assert (report["requests"], report["turns"], report["conversations"]) == (3, 2, 2)
    o = report["overhead"]
    for path in ("direct", "front"):
        assert o[path]["n"] == 3 and o[path]["failed"] == 0
        assert 0 < o[path]["p50_ms"] <= o[path]["p95_ms"]
        # warmed beforehand: every measured request found its whole prefix cached
        assert o[path]["cached_tokens_mean"] > o[path]["prompt_tokens_mean"] / 2
    assert o["added_p50_ms"] is not None and o["added_paired_median_ms"] is not None
    # the front gateway's own account: its TTFT less the replica's time to first token
    assert o["front_own_ms"]["n"] == 3 and o["front_own_ms"]["p50_ms"] >= 0
    r = report["routing"]
    assert r["affinity"]["replicas_per_conversation"] == [1, 1]  # each on one replica
    for mode in ("affinity", "random"):
        assert r[mode]["followup"]["n"] == 2 and r[mode]["failed"] == 0
        assert r[mode]["followup"]["mean_ms"] > 0
    assert r["affinity"]["followup_cached_tokens_mean"] > 0
    assert r["ratio_mean"] > 0 and "load balancer" in r["random_mode"]
    assert (tmp_path / "upstream.png").stat().st_size > 0
    assert "added at P50" in proc.stdout and "affinity / random" in proc.stdout
