"""The heap-freeze benchmark: its arguments, its body, and one small run (no model) checked
against what it wrote. Its timings are the benchmark's to report, not asserted here."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from bench.gc_freeze import main, parse_args, tiny_values_body


def test_arguments_and_their_limits(tmp_path: Path) -> None:
    args = parse_args(["--out", str(tmp_path)])
    assert (args.values, args.rounds, args.repeats, args.no_model) == (160_000, 5, 5, False)
    for bad in (["--values", "0"], ["--rounds", "0"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--out", str(tmp_path), *bad])


def test_the_body_is_a_chat_request_with_that_many_values() -> None:
    body = json.loads(tiny_values_body(1234))
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["tools"][0]["function"]["parameters"]["x"] == [[]] * 1234


def test_a_small_run_writes_every_round(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["--out", str(tmp_path), "--no-model", "--values", "2000", "--rounds", "2"]
    assert main([*argv, "--repeats", "1"]) == 0
    assert gc.get_freeze_count() == 0  # the process is left as it was
    report = json.loads((tmp_path / "gc_freeze.json").read_text())
    assert report["benchmark"] == "gc_freeze" and len(report["rounds"]) == 2
    for r in report["rounds"]:
        assert r["live_ms"] > 0 and r["frozen_ms"] > 0
        assert r["ratio"] == pytest.approx(r["live_ms"] / r["frozen_ms"], rel=0.01)  # as written
    assert report["heap_objects"] > 0 and report["body_bytes"] > 2000 * 2
    assert "live/frozen" in capsys.readouterr().out
