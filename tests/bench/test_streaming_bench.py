"""The streaming benchmark: its arguments, its summary, and one small run (the real gateway over
the null engine, and the raw servers) checked against what it wrote. Its speeds are the
benchmark's to report, not asserted here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.streaming import GOAL_RATIO, main, parse_args, summarize


def test_arguments_and_their_limits(tmp_path: Path) -> None:
    args = parse_args(["--out", str(tmp_path)])
    assert (args.deltas, args.clients, args.rounds, args.burst) == (200, [1, 50], 3, False)
    assert parse_args(["--quick"]).rounds == 1
    with pytest.raises(SystemExit):
        parse_args(["--deltas", "1"])


def _point(side: str, rate: float, latencies: list[float], round_: int = 0) -> dict:
    return {
        "round": round_,
        "protocol": "realtime",
        "clients": 1,
        "side": side,
        "messages_per_s": rate,
        "responses_per_s": rate / 208,
        "server_cpu_us_per_message": 1e6 / rate,
        "latencies_ms": latencies,
    }


def test_the_summary_pairs_each_side_and_judges_the_goal() -> None:
    points = [
        _point("raw", 1000.0, [3.0, 3.0, 4.0], 0),
        _point("gateway", 950.0, [3.5, 3.5, 5.0], 0),
        _point("raw", 1200.0, [3.0], 1),
        _point("gateway", 1000.0, [3.5], 1),
    ]
    (row,) = summarize(points)
    assert row["raw"]["messages_per_s"] == 1100.0  # the median of the rounds
    assert row["gateway"]["messages_per_s"] == 975.0
    assert row["ratio"] == pytest.approx(975.0 / 1100.0)
    assert row["ratio_of_rounds"] == pytest.approx((0.95 + 1000 / 1200) / 2)
    assert row["p50_delta_ms"] == pytest.approx(0.5)
    assert row["meets_goal"] is False  # 0.886x < GOAL_RATIO
    assert GOAL_RATIO == 0.9
    faster = summarize([_point("raw", 1000.0, [3.0]), _point("gateway", 950.0, [3.9])])
    assert faster[0]["meets_goal"] is True
    slower = summarize([_point("raw", 1000.0, [3.0]), _point("gateway", 950.0, [4.1])])
    assert slower[0]["meets_goal"] is False  # +1.1 ms a response


def test_a_small_run_measures_both_sides_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = ["--out", str(tmp_path), "--deltas", "20", "--clients", "1", "3"]
    assert main([*argv, "--seconds", "0.5", "--rounds", "1"]) == 0
    report = json.loads((tmp_path / "streaming.json").read_text())
    assert report["benchmark"] == "streaming" and report["status"] == "complete"
    assert len(report["points"]) == 2 * 2 * 2  # protocols x client counts x sides
    for point in report["points"]:
        assert point["messages_per_s"] > 0 and point["latencies_ms"]
        # CPU time is read in clock ticks (10 ms): a short window of the lean raw server may
        # count none of them, the gateway's windows over all points some
        assert point["server_cpu_us_per_message"] >= 0
    assert any(
        p["server_cpu_us_per_message"] > 0 for p in report["points"] if p["side"] == "gateway"
    )
    # the same messages a response from both sides: 20 deltas and the frames around them
    counts = {
        (p["protocol"], p["side"]): tuple(p["messages_per_response"]) for p in report["points"]
    }
    assert counts[("realtime", "raw")] == counts[("realtime", "gateway")]
    assert counts[("sse", "raw")] == counts[("sse", "gateway")]
    assert counts[("sse", "gateway")] == (20 + 3,)  # role chunk, 20 deltas, finish, [DONE]
    assert {(r["protocol"], r["clients"]) for r in report["rows"]} == {
        ("realtime", 1),
        ("realtime", 3),
        ("sse", 1),
        ("sse", 3),
    }
    assert "ratio" in capsys.readouterr().out
