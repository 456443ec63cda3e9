"""The load benchmark: its statistics, schedules and report pieces (fast), and one `--quick` run
against two real gateways (slow: loads the real language model twice)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench._load_client import SessionPlan, closed_loop, play_session, session_image
from bench._load_report import headline, headline_text, table_row
from bench._load_server import GatewayProcess
from bench._load_stats import (
    TurnRecord,
    percentile,
    poisson_arrivals,
    qps_at_slo,
    summarize,
    write_json,
)
from bench.load import parse_args

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- percentiles and summaries


def test_percentile_interpolates_between_closest_ranks() -> None:
    values = [10.0, 20.0, 30.0, 40.0, 50.0]
    assert percentile(values, 0) == 10.0
    assert percentile(values, 50) == 30.0
    assert percentile(values, 100) == 50.0
    assert percentile(values, 95) == pytest.approx(48.0)  # rank 3.8: 40 + 0.8 * 10
    assert percentile(reversed(values), 25) == 20.0  # order of input does not matter
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="0..100"):
        percentile(values, 101)


def test_percentile_counts_lost_turns_as_infinitely_late() -> None:
    values = [100.0] * 18 + [math.inf] * 2  # 10% lost
    assert percentile(values, 50) == 100.0
    assert percentile(values, 95) == math.inf
    assert percentile([100.0] * 99 + [math.inf], 95) == 100.0  # 1% lost: P95 unaffected


def _ok(
    session: int,
    turn: int,
    ttft: float,
    done_s: float,
    tokens: int = 10,
    itl: tuple[float, ...] = (50.0,),
) -> TurnRecord:
    return TurnRecord(
        session=session,
        turn=turn,
        sent_s=done_s - 1.0,
        done_s=done_s,
        ttft_ms=ttft,
        total_ms=ttft + 500.0,
        output_tokens=tokens,
        itl_ms=list(itl),
        cached_tokens=100 * turn,
    )


def test_summarize_splits_first_and_follow_up_turns_and_counts_failures() -> None:
    records = [
        _ok(0, 0, 900.0, 2.0),
        _ok(0, 1, 200.0, 3.0),
        _ok(0, 2, 220.0, 4.0),
        _ok(1, 0, 1100.0, 5.0, itl=(40.0, 60.0)),
        _ok(1, 1, 240.0, 11.0),  # finishes after the window
        TurnRecord(session=2, turn=0, sent_s=6.0, status="busy", error_code="busy"),
        TurnRecord(session=3, turn=0, sent_s=7.0, status="error", error_code="invalid_image"),
        TurnRecord(session=1, turn=2, sent_s=9.5, status="abandoned"),
    ]
    s = summarize(records, window_s=10.0)
    assert (s["turns"], s["turns_attempted"], s["sessions"]) == (5, 8, 4)
    assert (s["first_turns"], s["followup_turns"]) == (2, 3)
    assert (s["errors"], s["busy"], s["abandoned"]) == (1, 1, 1)
    assert s["error_codes"] == {"busy": 1, "invalid_image": 1}
    assert s["turns_per_s"] == pytest.approx(0.4)  # 4 ok turns done inside the 10 s window
    assert s["output_tok_per_s"] == pytest.approx(4.0)
    drained = summarize(records, window_s=10.0, count_drained=True)  # open loop: all 5 ok turns
    assert drained["turns_per_s"] == pytest.approx(0.5)
    assert s["ttft_first_p50_ms"] == pytest.approx(1000.0)
    assert s["ttft_followup_p50_ms"] == pytest.approx(220.0)
    assert s["ttft_followup_p99_ms"] == pytest.approx(239.6)
    assert s["itl_p95_ms"] == pytest.approx(57.5)  # gaps 40, 50, 50, 50, 50, 60: rank 4.75
    assert s["slo_p95_ms"] == math.inf  # 3 of 8 attempted turns were lost
    assert s["cached_tokens_mean"] == pytest.approx(80.0)  # (0 + 100 + 200 + 0 + 100) / 5
    with pytest.raises(ValueError):
        summarize(records, window_s=0)


def test_summarize_of_nothing_has_no_latencies() -> None:
    s = summarize([], window_s=5.0)
    assert s["turns"] == 0 and s["turns_per_s"] == 0.0
    assert s["ttft_first_p95_ms"] is None and s["slo_p95_ms"] is None and s["itl_p95_ms"] is None


# ---------------------------------------------------------------- arrivals


def test_poisson_schedule_is_seeded_and_respects_the_rate() -> None:
    a = poisson_arrivals(4.0, 2000.0, seed=7, max_count=100_000)
    assert a == poisson_arrivals(4.0, 2000.0, seed=7, max_count=100_000)
    assert a != poisson_arrivals(4.0, 2000.0, seed=8, max_count=100_000)
    assert a[0] == 0.0 and all(x < y for x, y in itertools.pairwise(a))
    assert a[-1] < 2000.0
    # 8000 arrivals expected; the Poisson count's sd is ~90, so 3% is over 2.5 sd
    assert len(a) == pytest.approx(8000, rel=0.03)
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.03)
    # exponential gaps: the sd equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.06)


def test_poisson_schedule_bounds() -> None:
    assert len(poisson_arrivals(100.0, 10.0, seed=1, max_count=5)) == 5
    light = poisson_arrivals(0.05, 10.0, seed=3, max_count=50, min_count=3, max_duration_s=10_000)
    assert len(light) == 3 and light[-1] > 10.0  # stretched past the window to get 3 sessions
    capped = poisson_arrivals(0.05, 10.0, seed=3, max_count=50, min_count=3, max_duration_s=10.0)
    assert capped and capped[-1] < 10.0
    for bad in ({"rate": 0.0}, {"rate": -1.0}):
        with pytest.raises(ValueError):
            poisson_arrivals(bad["rate"], 10.0, seed=1, max_count=5)
    with pytest.raises(ValueError):
        poisson_arrivals(1.0, 10.0, seed=1, max_count=0)


# ---------------------------------------------------------------- QPS at SLO


def test_qps_at_slo_takes_the_highest_rate_within_the_slo() -> None:
    points = [
        {"offered_turns_per_s": 0.5, "slo_p95_ms": 900.0, "turns": 6},
        {"offered_turns_per_s": 1.0, "slo_p95_ms": 1900.0, "turns": 12},
        {"offered_turns_per_s": 2.0, "slo_p95_ms": 2100.0, "turns": 20},
        {"offered_turns_per_s": 4.0, "slo_p95_ms": math.inf, "turns": 9},
        {"offered_turns_per_s": 8.0, "slo_p95_ms": None, "turns": 0},
    ]
    assert qps_at_slo(points, 2000.0) == 1.0
    assert qps_at_slo(points, 2100.0) == 2.0
    assert qps_at_slo(points, 800.0) is None
    assert qps_at_slo([], 2000.0) is None


def test_headline_ratios_and_fallback_concurrency() -> None:
    def closed(config: str, c: int, tok: float, f50: float, f95: float) -> dict:
        return {
            "kind": "closed",
            "config": config,
            "concurrency": c,
            "output_tok_per_s": tok,
            "ttft_followup_p50_ms": f50,
            "ttft_followup_p95_ms": f95,
        }

    points = [
        closed("baseline", 1, 10, 1000, 1100),
        closed("visiongate", 1, 12, 200, 250),
        closed("baseline", 2, 10, 2000, 2500),
        closed("visiongate", 2, 30, 300, 400),
    ]
    h = headline(points, {"baseline": 0.5, "visiongate": 2.0})
    assert h["concurrency"] == 2  # no 8-session point: the highest below it
    assert h["vg_tok_per_s_ratio"] == pytest.approx(2.5)
    assert h["vg_followup_p95_ratio"] == pytest.approx(2.0)
    assert h["baseline_followup_p95_ratio"] == pytest.approx(2.5)
    assert h["qps_at_slo_ratio"] == pytest.approx(4.0)
    assert h["qps_at_slo_lower_bound"] == {"baseline": False, "visiongate": False}
    opened = [
        {"kind": "open", "config": c, "offered_turns_per_s": r}
        for c in ("baseline", "visiongate")
        for r in (0.5, 1.0, 2.0)
    ]
    bound = headline(points + opened, {"baseline": 0.5, "visiongate": 2.0})
    assert bound["qps_at_slo_lower_bound"] == {"baseline": False, "visiongate": True}
    assert ">= 4.00x" in headline_text(bound, 1000.0, "rule")
    assert headline(points, {"baseline": None, "visiongate": 2.0})["qps_at_slo_ratio"] is None
    row = table_row(
        "closed c=2",
        None,
        {**points[3], "turns_per_s": 1.0, "errors": 0, "busy": 0, "abandoned": 0},
    )
    assert row.startswith("closed c=2") and "-" in row


# ---------------------------------------------------------------- writer, workload, settings


def test_write_json_is_strict_and_keeps_every_point(tmp_path: Path) -> None:
    rec = TurnRecord(session=0, turn=1, sent_s=0.5, ttft_ms=12.3456, itl_ms=[1.0, math.inf])
    report = {
        "points": [
            {"config": "baseline", "slo_p95_ms": math.inf, "records": [rec]},
            {"config": "visiongate", "slo_p95_ms": 10.0, "nan": math.nan},
        ],
        "path": tmp_path,
        "pair": (1, 2),
    }
    path = write_json(tmp_path / "load.json", report)
    text = path.read_text()
    assert "Infinity" not in text and "NaN" not in text
    data = json.loads(text)
    assert [p["config"] for p in data["points"]] == ["baseline", "visiongate"]
    assert data["points"][0]["slo_p95_ms"] is None
    assert data["points"][0]["records"][0]["ttft_ms"] == 12.346
    assert data["points"][0]["records"][0]["itl_ms"] == [1.0, None]
    assert data["pair"] == [1, 2] and data["path"] == str(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["load.json"]  # no temporary left


def test_every_session_gets_a_distinct_photo() -> None:
    photos: dict = {}
    indices = [*range(14), 6 * 64, 6 * 65]  # photos, mirrors, crops along x, then along y
    images = [session_image(i, photos) for i in indices]
    assert all(img[:2] == b"\xff\xd8" for img in images)
    assert len({hashlib.sha256(img).hexdigest() for img in images}) == len(images)
    assert session_image(3) == images[3]  # the same index, the same photo, in every config
    with pytest.raises(ValueError, match="distinct"):
        session_image(6 * 2048)


def test_quick_arguments_and_the_reference_point() -> None:
    a = parse_args(["--quick", "--out", "x"])
    assert a.concurrency == [1, 2] and len(a.rate_multipliers) == 1 and a.tokens == 8
    assert a.extra_rungs == 0
    b = parse_args(["--concurrency", "4,2"])
    assert b.concurrency == [1, 2, 4] and b.tokens == 24  # 1 session always runs
    with pytest.raises(SystemExit):
        parse_args(["--rates", "0,1"])
    with pytest.raises(SystemExit):  # more sessions than distinct photos
        parse_args(["--max-sessions", "5000"])


def test_gateway_settings_only_pass_fields_the_gateway_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VISIONGATE_REDIS_URL", "redis://10.1.2.3:6379/0")  # never off loopback
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://10.1.2.3:4318")
    monkeypatch.setenv("VISIONGATE_LM_DTYPE", "bfloat16")  # the model's choice is inherited
    gw = GatewayProcess(
        "t",
        {"vision_cache_bytes": 0, "no_such_setting": 3, "log_level": "warning"},
        tmp_path / "gw.log",
    )
    assert gw.applied == {"vision_cache_bytes": 0, "log_level": "warning"}
    assert gw.skipped == ["no_such_setting"]
    assert gw.env["VISIONGATE_VISION_CACHE_BYTES"] == "0"
    assert gw.env["VISIONGATE_HOST"] == "127.0.0.1"
    assert "VISIONGATE_NO_SUCH_SETTING" not in gw.env
    assert "VISIONGATE_REDIS_URL" not in gw.env and "OTEL_EXPORTER_OTLP_ENDPOINT" not in gw.env
    effective = gw.effective_settings()
    assert effective["vision_cache_bytes"] == 0 and effective["redis_url"] is None
    assert effective["lm_dtype"] == "bfloat16"
    gw.stop()  # never started: nothing to stop, no error


# ------------------------------------------------------- the client against a scripted peer
# A loopback WebSocket peer that answers with fixed timings (or refuses), to check what the
# client measures and how it classifies failures; the end-to-end test below uses real gateways.


class ScriptedPeer:
    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.items_per_connection: list[list[dict]] = []
        self.server = None

    async def handler(self, ws) -> None:
        items: list[dict] = []
        self.items_per_connection.append(items)
        await ws.send(json.dumps({"type": "session.created", "session": {"id": "sess_x"}}))
        async for frame in ws:
            event = json.loads(frame)
            if event["type"] == "conversation.item.create":
                items.append(event["item"])
                continue
            if self.behaviour == "silent":
                continue
            if self.behaviour == "busy":
                await ws.send(
                    json.dumps(
                        {
                            "type": "error",
                            "error": {
                                "type": "server_error",
                                "code": "busy",
                                "message": "engine queue is full",
                                "param": None,
                                "event_id": event["event_id"],
                            },
                        }
                    )
                )
                continue
            await ws.send(json.dumps({"type": "response.created", "response": {"id": "resp_1"}}))
            await asyncio.sleep(0.06)
            for i in range(3):
                if i:
                    await asyncio.sleep(0.04)
                await ws.send(json.dumps({"type": "response.output_text.delta", "delta": f"w{i} "}))
            await ws.send(
                json.dumps(
                    {
                        "type": "response.done",
                        "response": {
                            "id": "resp_1",
                            "status": "completed",
                            "output": [{"content": [{"type": "output_text", "text": "w0 w1 w2 "}]}],
                            "usage": {
                                "input_tokens": 50,
                                "output_tokens": 3,
                                "input_token_details": {"cached_tokens": 7},
                            },
                            "visiongate": {
                                "timings": {"encode_ms": 1.5},
                                "cache": {"vision": "hit"},
                            },
                        },
                    }
                )
            )

    async def __aenter__(self) -> str:
        import websockets

        self.server = await websockets.serve(self.handler, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"ws://127.0.0.1:{port}/v1/realtime"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()


PLAN = SessionPlan(
    index=5, image_url="data:image/jpeg;base64,/9j/AA==", questions=("q1", "q2", "q3")
)
PLAY = {"typing_s": 0.0, "max_tokens": 8, "turn_timeout_s": 10.0}


@pytest.mark.parametrize("mode", ["stateful", "stateless"])
async def test_client_measures_ttft_and_gaps_between_deltas(mode: str) -> None:
    peer = ScriptedPeer("stream")
    async with peer as url:
        records: list[TurnRecord] = []
        loop = asyncio.get_running_loop()
        await play_session(url, PLAN, mode, records, origin=loop.time(), stop_at=None, **PLAY)
    assert [(r.turn, r.status) for r in records] == [(0, "ok"), (1, "ok"), (2, "ok")]
    for r in records:
        # the peer waits 60 ms before the first delta and 40 ms between deltas: nothing can
        # arrive sooner (later, on a busy machine, it may)
        assert 60.0 <= r.ttft_ms < 2000.0 and len(r.itl_ms) == 2
        assert all(g > 0 for g in r.itl_ms) and r.ttft_ms + sum(r.itl_ms) >= 140.0
        assert (r.output_tokens, r.cached_tokens, r.vision, r.encode_wait_ms) == (3, 7, "hit", 1.5)
        assert r.total_ms >= r.ttft_ms and r.done_s > r.sent_s
    kinds = [
        [(i["role"], [p["type"] for p in i["content"]]) for i in conn]
        for conn in peer.items_per_connection
    ]
    if mode == "stateful":  # one connection: the photo alone first, then each question
        assert kinds == [
            [
                ("user", ["input_image"]),
                ("user", ["input_text"]),
                ("user", ["input_text"]),
                ("user", ["input_text"]),
            ]
        ]
    else:  # a connection per turn, resending the conversation with the photo in the question
        first = ("user", ["input_image", "input_text"])
        answer, question = ("assistant", ["output_text"]), ("user", ["input_text"])
        assert kinds == [
            [first],
            [first, answer, question],
            [first, answer, question, answer, question],
        ]
        assert peer.items_per_connection[2][1]["content"][0]["text"] == "w0 w1 w2 "


async def test_client_classifies_busy_refused_and_abandoned_turns() -> None:
    loop = asyncio.get_running_loop()
    async with ScriptedPeer("busy") as url:
        busy: list[TurnRecord] = []
        await play_session(url, PLAN, "stateful", busy, origin=loop.time(), stop_at=None, **PLAY)
    assert [(r.turn, r.status, r.error_code) for r in busy] == [(0, "busy", "busy")]

    refused: list[TurnRecord] = []
    await play_session(url, PLAN, "stateless", refused, origin=loop.time(), stop_at=None, **PLAY)
    assert len(refused) == 1 and refused[0].status == "error"
    assert refused[0].error_code.startswith("connection:")

    async with ScriptedPeer("silent") as url:
        hung: list[TurnRecord] = []
        task = asyncio.create_task(
            play_session(url, PLAN, "stateful", hung, origin=loop.time(), stop_at=None, **PLAY)
        )
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert [(r.turn, r.status) for r in hung] == [(0, "abandoned")]


async def test_closed_loop_is_bounded_in_time() -> None:
    loop = asyncio.get_running_loop()
    plans = itertools.count()
    async with ScriptedPeer("silent") as url:
        t0 = loop.time()
        records = await closed_loop(
            url,
            "stateful",
            3,
            lambda: SessionPlan(next(plans), PLAN.image_url, PLAN.questions),
            window_s=0.4,
            drain_s=0.3,
            max_sessions=10,
            **PLAY,
        )
        assert loop.time() - t0 < 3.0
    assert len(records) == 3 and all(r.status == "abandoned" for r in records)


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.load", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "headline" in proc.stdout and "closed c=2" in proc.stdout
    report = json.loads((out / "load.json").read_text())
    assert report["status"] == "complete"
    assert (out / "load.png").stat().st_size > 10_000
    assert set(report["configs"]) == {"baseline", "visiongate"}
    assert report["configs"]["baseline"]["effective_settings"]["vision_cache_bytes"] == 0
    assert report["slo"]["ttft_p95_ms"] > 0
    points = report["points"]
    for config in ("baseline", "visiongate"):
        kinds = {(p["kind"], p.get("concurrency")) for p in points if p["config"] == config}
        assert {("closed", 1), ("closed", 2), ("open", None)} <= kinds, kinds
    for p in points:
        assert p["turns"] > 0 and p["errors"] == 0 and p["busy"] == 0, p
    records = {
        c: [r for p in points if p["config"] == c for r in p["records"] if r["status"] == "ok"]
        for c in ("baseline", "visiongate")
    }
    # stateless serving reuses nothing; visiongate's follow-ups reuse the session's KV
    assert all(r["cached_tokens"] == 0 for r in records["baseline"])
    assert any(r["turn"] > 0 and r["cached_tokens"] > 0 for r in records["visiongate"])
