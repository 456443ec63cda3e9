"""bench.precision on the real default model: its corpus, its scores and its report."""

from __future__ import annotations

import math

import pytest

from bench import precision

pytestmark = pytest.mark.slow


def test_corpus_ships_with_python_and_cuts_into_whole_windows() -> None:
    from transformers import AutoTokenizer

    from gateway.testing.vllm_server import default_model_dir

    text = precision.corpus_text()
    assert len(text) > 100_000 and "assert" in text
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    windows = precision.corpus_windows(tok, 3, 64)
    assert len(windows) == 3 and all(len(w) == 64 for w in windows)
    assert windows[0] != windows[1]


def test_prefix_share_counts_the_reference_up_to_the_first_difference() -> None:
    assert precision._prefix_share("abcd", "abXd") == 0.5
    assert precision._prefix_share("abcd", "abcd") == 1.0
    assert precision._prefix_share("abcd", "ab") == 0.5
    assert precision._prefix_share("", "x") == 1.0


def test_each_precision_is_scored_against_float32() -> None:
    found = precision.perplexities(None, 2, 48, ("int8",))
    ref, int8 = found["float32"], found["int8"]
    assert ref["ratio"] == 1.0 and ref["top1_agreement"] == 1.0
    assert math.isfinite(int8["perplexity"]) and int8["perplexity"] > 1.0
    assert int8["ratio"] == pytest.approx(int8["perplexity"] / ref["perplexity"])
    # int8 weights with one scale per channel stay close to float32 (bench: 1.002, 95%)
    assert 0.9 < int8["ratio"] < 1.1
    assert int8["top1_agreement"] > 0.8
    assert found["_corpus"] == {"windows": 2, "corpus_tokens": 96}
    text = precision.report(found, {"int8": {"identical": 0.5, "prefix_share": 0.75}})
    assert "int8" in text and "0.500" in text and "0.750" in text


def test_unknown_precisions_are_refused() -> None:
    with pytest.raises(SystemExit, match="--precisions"):
        precision.main(["--precisions", "int4", "--no-greedy"])
