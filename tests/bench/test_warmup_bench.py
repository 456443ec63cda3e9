"""The KV warm-up benchmark: its arguments, and one quick run checked against what it wrote.
Its timings are the benchmark's to report, not asserted here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.warmup import CONDITIONS, main, parse_args, photo


def test_arguments_and_their_limits(tmp_path: Path) -> None:
    args = parse_args(["--out", str(tmp_path)])
    assert (args.trials, args.load, args.ahead) == (3, 8, 3.0)
    quick = parse_args(["--out", str(tmp_path), "--quick"])
    assert (quick.trials, quick.load, quick.ahead) == (1, 2, 1.0)
    for bad in (["--trials", "0"], ["--load", "-1"], ["--ahead", "-1"], ["--max-tokens", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--out", str(tmp_path), *bad])


def test_every_trial_has_a_photo_of_its_own() -> None:
    assert len({photo(i) for i in range(6)}) == 6


@pytest.mark.slow
def test_a_quick_run_writes_every_phase(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--out", str(tmp_path), "--quick"]) == 0
    report = json.loads((tmp_path / "warmup.json").read_text())
    assert report["benchmark"] == "warmup"
    summary = report["summary"]
    for gateway in ("warmup", "no_warmup"):
        for phase in ("alone", "load2"):
            s = summary[f"{gateway}/{phase}"]
            rows = report["results"][gateway][phase]["rows"]
            assert sorted(r["condition"] for r in rows) == sorted(CONDITIONS)
            medians = s["ttft_ms_median"]
            for c in CONDITIONS:
                assert medians[c] > 0
                assert s["ratio_vs_text_followup"][c] == pytest.approx(
                    medians[c] / medians["text_followup"], rel=0.01
                )
            for r in rows:
                assert 0 <= r["kv_warmed_tokens"] <= r["input_tokens"] - r["prefill_tokens"]
            if gateway == "no_warmup":
                assert all(r["kv_warmed_tokens"] == 0 for r in rows)
        # the load's decodes were measured while the viewer ran
        assert summary[f"{gateway}/load2"]["other_sessions_decode_p95_ms"] > 0
    assert isinstance(summary["answers_equal_with_and_without_warmup"], bool)
    out = capsys.readouterr().out
    assert "ratio to the text-only follow-up" in out and "photo_ahead" in out
