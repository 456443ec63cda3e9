"""The structured-output benchmark: its summary and table (fast), and one tiny run on the real
model in a child process, checked against what it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.structured import GRAMMAR, parse_args, summarize, table

ROOT = Path(__file__).resolve().parents[2]


def _run(ms_per_token: float, tokens_per_s: float = 10.0) -> dict:
    return {
        "wall_s": 1.0,
        "output_tokens": 10,
        "tokens_per_s": tokens_per_s,
        "ms_per_token": ms_per_token,
        "finish_reasons": ["length"],
        "texts": ["{}"],
    }


def test_arguments_and_their_limits(tmp_path: Path) -> None:
    args = parse_args(["--out", str(tmp_path)])
    assert args.batches == [1, 8] and args.tokens == 16 and args.rounds == 3
    assert parse_args(["--out", str(tmp_path), "--batches", "2, 4"]).batches == [2, 4]
    for bad in (["--batches", "0"], ["--batches", "x"], ["--tokens", "1"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--out", str(tmp_path), *bad])


def test_overhead_is_the_median_of_each_rounds_ratio() -> None:
    # the machine slowed down in round 2: both runs of that round saw it, the ratio did not
    runs = {
        "plain": [_run(10.0), _run(40.0), _run(10.0)],
        "grammar": [_run(10.5), _run(42.0), _run(11.5)],
    }
    row = summarize(runs)
    assert row["overhead_per_round"] == [1.05, 1.05, 1.15]
    assert row["overhead_per_token"] == 1.05
    assert row["plain"]["ms_per_token"] == 10.0 and row["grammar"]["ms_per_token"] == 11.5
    assert row["plain"]["finish_reasons"] == ["length"]


def test_table_has_a_row_per_batch() -> None:
    row = summarize({"plain": [_run(10.0)], "grammar": [_run(11.0)]})
    row.update(grammar_ms_per_step=0.2, overhead_bound=1.02)
    text = table({"batches": {"1": row, "8": row}})
    lines = text.strip().splitlines()
    assert len(lines) == 4 and lines[2].startswith("| 1 |") and lines[3].startswith("| 8 |")
    assert "1.1x" in lines[2] and "1.02x" in lines[2]


@pytest.mark.slow
def test_tiny_run_writes_json_and_table(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.structured",
            "--out",
            str(tmp_path),
            "--tokens",
            "4",
            "--rounds",
            "1",
            "--batches",
            "1,2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "structured:" in proc.stderr  # the progress bar
    report = json.loads((tmp_path / "structured.json").read_text())
    assert report["grammar"] == GRAMMAR and report["tokens"] == 4
    assert set(report["batches"]) == {"1", "2"}
    for row in report["batches"].values():
        for mode in ("plain", "grammar"):
            assert row[mode]["finish_reasons"] == ["length"]  # both ran to the token limit
            assert row[mode]["tokens_per_s"] > 0 and row[mode]["ms_per_token"] > 0
        assert row["overhead_per_token"] > 0 and row["grammar_ms_per_step"] > 0
        assert row["overhead_bound"] >= 1.0
        assert row["sample_answer"].startswith("{")
    markdown = (tmp_path / "structured.md").read_text()
    assert markdown.count("\n") == 4
    assert markdown in proc.stdout
