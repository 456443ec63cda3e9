"""`bench.load --adaptive-compare`: its arguments, gateway settings, visual-budget numbers, table
and chart (fast), the client reading the budget reports off a scripted Realtime peer (fast), and
one short run against two real gateways (slow: loads the real language model twice)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench._load_adaptive import (
    ADAPTIVE_HEADER,
    adaptive_chart,
    adaptive_headline,
    adaptive_overrides,
    adaptive_row,
)
from bench._load_client import SessionPlan, play_session
from bench._load_server import GatewayProcess
from bench._load_stats import TurnRecord, summarize, within_slo_share
from bench.load import parse_args

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- arguments and settings


def test_adaptive_arguments() -> None:
    a = parse_args(["--adaptive-compare", "--budget-objective-ms", "800", "--budget-step", "0.2"])
    assert a.adaptive_compare and a.budget_objective_ms == 800 and a.budget_step == 0.2
    assert a.rate_multipliers == [0.5, 1.0, 2.0, 4.0]  # multiples of a batching gateway's capacity
    assert parse_args(["--adaptive-compare", "--quick"]).rate_multipliers == [0.5]
    assert parse_args([]).rate_multipliers[0] == 0.25  # the baseline comparison is unchanged
    with pytest.raises(SystemExit):  # the budget's knobs belong to the comparison
        parse_args(["--budget-floor", "0.2"])
    with pytest.raises(SystemExit):
        parse_args(["--adaptive-compare", "--budget-window-s", "0"])


def test_adaptive_gateways_differ_only_by_the_budget(tmp_path: Path) -> None:
    args = parse_args(
        [
            "--adaptive-compare",
            "--budget-floor",
            "0.2",
            "--budget-window-s",
            "8",
            "--max-queue",
            "9",
        ]
    )
    off = GatewayProcess("off", adaptive_overrides("budget_off", args, 900.0), tmp_path / "a.log")
    on = GatewayProcess("on", adaptive_overrides("budget_on", args, 900.0), tmp_path / "b.log")
    assert off.skipped == [] and on.skipped == []  # every setting exists in this gateway build
    eff_off, eff_on = off.effective_settings(), on.effective_settings()
    assert eff_off["visual_budget_adaptive"] is False and eff_on["visual_budget_adaptive"] is True
    assert eff_on["visual_budget_ttft_ms"] == 900.0 and eff_on["visual_budget_floor"] == 0.2
    assert eff_on["visual_budget_window_s"] == 8.0
    assert eff_on["visual_budget_step"] == eff_off["visual_budget_step"]  # not given: default
    differ = {k for k in eff_on if eff_on[k] != eff_off[k] and k != "port"}
    assert differ == {
        "visual_budget_adaptive",
        "visual_budget_ttft_ms",
        "visual_budget_floor",
        "visual_budget_window_s",
    }
    assert eff_on["engine_max_queue"] == eff_off["engine_max_queue"] == 9
    assert eff_on["prefix_caching"] is True and eff_on["vision_cache_bytes"] > 0  # defaults


# ---------------------------------------------------------------- the budget's numbers


def _turn(session: int, turn: int, ttft: float | None, **kw) -> TurnRecord:
    ok = ttft is not None
    return TurnRecord(
        session=session,
        turn=turn,
        sent_s=float(session),
        status="ok" if ok else "abandoned",
        done_s=session + 1.0 if ok else None,
        ttft_ms=ttft,
        total_ms=None if ttft is None else ttft + 100.0,
        **kw,
    )


def test_summary_reports_kept_ratio_budget_encodes_and_share_within_slo() -> None:
    records = [
        _turn(
            0,
            0,
            900.0,
            image_tokens=98,
            image_tokens_total=196,
            visual_budget=0.5,
            image_encode="miss",
        ),
        _turn(0, 1, 200.0, image_tokens=98, image_tokens_total=196, visual_budget=0.3),
        _turn(
            1,
            0,
            2500.0,
            image_tokens=20,
            image_tokens_total=196,
            visual_budget=0.1,
            image_encode="miss",
        ),
        _turn(
            2,
            0,
            1200.0,
            image_tokens=59,
            image_tokens_total=196,
            visual_budget=0.3,
            image_encode="hit",
        ),
        _turn(2, 1, None),  # lost: never within the SLO
    ]
    s = summarize(records, window_s=10.0, count_drained=True, slo_ms=1000.0)
    # first turns only: each photo once, whatever its follow-ups repeat
    assert s["kept_ratio_mean"] == pytest.approx((98 + 20 + 59) / 3 / 196)
    assert s["image_tokens_mean"] == pytest.approx((98 + 20 + 59) / 3)
    assert (s["visual_budget_min"], s["visual_budget_max"]) == (0.1, 0.5)
    assert s["visual_budget_mean"] == pytest.approx(0.3)
    assert s["images_encoded"] == 2  # the third photo came from the cache
    assert s["within_slo_share"] == pytest.approx(2 / 5)
    assert within_slo_share(records, 3000.0) == pytest.approx(4 / 5)
    assert within_slo_share([], 1000.0) is None
    plain = summarize([_turn(0, 0, 500.0)], window_s=1.0)  # no image, no budget, no SLO
    assert plain["kept_ratio_mean"] is None and plain["visual_budget_mean"] is None
    assert plain["within_slo_share"] is None and plain["images_encoded"] == 0


def _open(cfg: str, rate: float, p95: float | None, kept: float, cap: float | None) -> dict:
    return {
        "kind": "open",
        "config": cfg,
        "offered_turns_per_s": rate,
        "turns_per_s": min(rate, 1.0),
        "turns": 10,
        "slo_p95_ms": p95,
        "ttft_first_p95_ms": p95,
        "within_slo_share": 0.9,
        "kept_ratio_mean": kept,
        "visual_budget_mean": cap,
        "visual_budget_min": cap,
        "visual_budget_max": cap,
        "images_encoded": 3,
        "errors": 0,
        "busy": 0,
        "abandoned": 1,
    }


def test_headline_table_and_chart(tmp_path: Path) -> None:
    points = [
        _open("budget_off", 0.5, 800.0, 0.49, None),
        _open("budget_on", 0.5, 800.0, 0.49, 0.5),
        _open("budget_off", 1.0, 2500.0, 0.49, None),
        _open("budget_on", 1.0, 1500.0, 0.2, 0.1),
        _open("budget_off", 2.0, math.inf, 0.49, None),
        _open("budget_on", 2.0, 3000.0, 0.1, 0.1),
    ]
    h = adaptive_headline(points, 2000.0)
    assert h["qps_at_slo"] == {"budget_off": 0.5, "budget_on": 1.0}
    assert h["qps_at_slo_ratio"] == pytest.approx(2.0)
    assert h["qps_at_slo_lower_bound"] == {"budget_off": False, "budget_on": False}
    assert adaptive_headline(points[:4], 2000.0)["qps_at_slo_lower_bound"]["budget_on"] is True
    assert adaptive_headline(points, 100.0)["qps_at_slo_ratio"] is None
    row = adaptive_row(1.0, points[2], points[3])
    assert row.split()[:5] == ["1", "1.00", "1.00", "2500", "1500"]
    assert "0.10 [0.10-0.10]" in row and "0/0/1" in row
    assert "inf" in adaptive_row(2.0, points[4], None)  # a lost P95; a missing point is '-'
    assert len(ADAPTIVE_HEADER.splitlines()) == 2
    png = adaptive_chart(points, 2000.0, 1000.0, tmp_path / "a.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# ------------------------------------------------------- the client against a scripted peer


async def test_client_reads_the_budget_reports() -> None:
    """The photo's visiongate.image.encoded, the prompt's visual tokens and the cap in force
    reach the turn records, turn by turn."""
    import websockets

    caps = iter([0.5, 0.3, 0.3])

    async def handler(ws) -> None:
        await ws.send(json.dumps({"type": "session.created", "session": {"id": "s"}}))
        async for frame in ws:
            event = json.loads(frame)
            if event["type"] == "conversation.item.create":
                if event["item"]["content"][0]["type"] == "input_image":
                    encoded = {"type": "visiongate.image.encoded", "cache": "miss"}
                    await ws.send(json.dumps({**encoded, "tokens_kept": 60, "tokens_total": 196}))
                continue
            await ws.send(json.dumps({"type": "response.output_text.delta", "delta": "a"}))
            usage = {"output_tokens": 1, "input_token_details": {"image_tokens": 60}}
            ext = {"image_tokens_total": 196, "cache": {"visual_budget": next(caps)}}
            done = {"status": "completed", "output": [], "usage": usage, "visiongate": ext}
            await ws.send(json.dumps({"type": "response.done", "response": done}))

    server = await websockets.serve(handler, "127.0.0.1", 0)
    try:
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/realtime"
        plan = SessionPlan(0, "data:image/jpeg;base64,/9j/AA==", ("q1", "q2", "q3"))
        records: list[TurnRecord] = []
        loop = asyncio.get_running_loop()
        await play_session(
            url,
            plan,
            "stateful",
            records,
            origin=loop.time(),
            stop_at=None,
            typing_s=0.0,
            max_tokens=4,
            turn_timeout_s=10.0,
        )
    finally:
        server.close()
        await server.wait_closed()
    assert [r.status for r in records] == ["ok"] * 3
    assert [r.image_encode for r in records] == ["miss", None, None]
    assert [r.visual_budget for r in records] == [0.5, 0.3, 0.3]
    assert all((r.image_tokens, r.image_tokens_total) == (60, 196) for r in records)


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_adaptive_compare_end_to_end(tmp_path: Path) -> None:
    """Two real gateways, budget off and on: every session's photo is encoded by each, the
    budget-on responses report the cap in force, budget-off ones none."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "bench.load",
        "--adaptive-compare",
        "--out",
        str(out),
        "--rates",
        "0.5",
        "--tokens",
        "4",
        "--point-s",
        "1.5",
        "--open-point-s",
        "2",
        "--drain-s",
        "6",
        "--typing-s",
        "0.1",
        "--slo-ms",
        "8000",
        "--budget-objective-ms",
        "1",
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "QPS at SLO (P95 TTFT <= 8000 ms)" in proc.stdout
    assert "set below it by --budget-objective-ms" in proc.stdout
    report = json.loads((out / "load_adaptive.json").read_text())
    assert report["status"] == "complete" and report["budget_objective_ms"] == 1
    assert (out / "load_adaptive.png").stat().st_size > 10_000
    on = report["configs"]["budget_on"]["effective_settings"]
    assert on["visual_budget_adaptive"] is True and on["visual_budget_ttft_ms"] == 1
    assert report["configs"]["budget_off"]["effective_settings"]["visual_budget_adaptive"] is False
    opened = {p["config"]: p for p in report["points"] if p["kind"] == "open"}
    assert set(opened) == {"budget_off", "budget_on"}
    for cfg, p in opened.items():
        assert p["errors"] == 0 and p["busy"] == 0 and p["turns"] > 0, p
        firsts = [r for r in p["records"] if r["turn"] == 0 and r["status"] == "ok"]
        assert firsts and all(r["image_encode"] == "miss" for r in firsts), cfg
        assert p["images_encoded"] == len(firsts)
        assert all(0 < r["image_tokens"] <= r["image_tokens_total"] for r in firsts)
        assert 0 < p["kept_ratio_mean"] <= 0.5 + 0.01  # the configured cap, max_keep_ratio
        assert 0 <= p["within_slo_share"] <= 1
    assert all(r["visual_budget"] is None for r in opened["budget_off"]["records"])
    caps = [r["visual_budget"] for r in opened["budget_on"]["records"] if r["status"] == "ok"]
    assert caps and all(0.1 <= c <= 0.5 for c in caps)
