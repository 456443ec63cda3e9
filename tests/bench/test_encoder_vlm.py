"""The VLM quality table of the encoder benchmark on a tiny random-weight Qwen2.5-VL checkpoint
(M-RoPE, dynamic resolution) and two real photos: the exact path agrees with an independent
re-run of itself, every field is there, and the optimized path keeps fewer, smaller tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import _encoder_vlm as vlm
from bench._encoder_vlm_report import plot_vlm
from bench.encoder import main, photo_bytes
from tests.vlm_checkpoints import qwen2_5_vl

PHOTOS = ("astronaut", "chelsea")
STEPS = 4
REPEATS = 2


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> dict:
    ckpt = qwen2_5_vl.build(tmp_path_factory.mktemp("qwen") / "ckpt")
    photos = {k: v for k, v in photo_bytes().items() if k in PHOTOS}
    lines: list[str] = []
    res = vlm.measure_checkpoint(
        ckpt,
        photos,
        repeats=REPEATS,
        steps=STEPS,
        device="cpu",
        random_weights=True,
        progress=lines.append,
    )
    res["progress"] = lines
    return res


def test_reference_agrees_with_itself(table: dict) -> None:
    ref = table["configs"]["reference"]
    assert (ref["pruning"], ref["visual_tokens"]) == ("none", "fp32")
    assert ref["top1_agreement"] == 1.0
    assert ref["greedy_agreement"] == 1.0 and ref["greedy_prefix_mean"] == 1.0
    assert ref["logit_cosine_min"] == pytest.approx(1.0, abs=1e-5)
    assert ref["logit_cosine_mean"] == pytest.approx(1.0, abs=1e-5)
    for photo in PHOTOS:
        row = ref["per_photo"][photo]
        assert row["greedy_tokens"] == table["anchor_greedy_tokens"][photo]
        assert len(row["greedy_tokens"]) == STEPS
        assert row["tokens_kept"] == row["tokens_total"] > 0  # nothing dropped
        assert len(row["encode_ms"]) == REPEATS


def test_table_has_every_field(table: dict) -> None:
    assert table["family"] == "qwen2_5_vl" and table["random_weights"] is True
    assert table["photos"] == list(PHOTOS)
    assert set(table["configs"]) == set(vlm.CONFIGS)
    for name, row in table["configs"].items():
        missing = [f for f in vlm.TABLE_FIELDS if f not in row]
        assert not missing, (name, missing)
        assert set(row["per_photo"]) == set(PHOTOS)
        assert 0.0 <= row["top1_agreement"] <= 1.0
        assert -1.0 <= row["logit_cosine_min"] <= row["logit_cosine_mean"] <= 1.0 + 1e-6
        assert row["encode_ms_mean"] > 0 and row["images_per_s"] > 0
        assert row["payload_bytes_mean"] > 0
        assert set(row["stage_ms_median"]) >= {"decode", "vision", "prune", "quantize"}
    for key in (
        "top1_agreement",
        "logit_cosine_mean",
        "tokens_kept_ratio",
        "encode_speedup_vs_reference",
        "payload_bytes_ratio_vs_reference",
    ):
        assert key in table["summary"], key
    wrong = table["wrong_image"]
    assert set(wrong) == {"top1_agreement", "logit_cosine_mean"}
    assert wrong["logit_cosine_mean"] < 1.0 - 1e-6  # another photo moves the logits
    json.dumps(table)  # the JSON file takes it as it is
    # progress went to the callback: one line per photo and config per repeat, and per check
    encodes = [line for line in table["progress"] if " ms " in line]
    assert len(encodes) == REPEATS * len(PHOTOS) * len(vlm.CONFIGS)


def test_optimized_keeps_fewer_smaller_tokens(table: dict) -> None:
    ref, opt = table["configs"]["reference"], table["configs"]["optimized"]
    int4, drop = table["configs"]["int4_only"], table["configs"]["drop_only"]
    assert (opt["pruning"], opt["visual_tokens"]) == ("dynamic", "int4")
    assert opt["tokens_kept_mean"] < ref["tokens_kept_mean"] == ref["tokens_total_mean"]
    assert drop["tokens_kept_mean"] == opt["tokens_kept_mean"]
    assert int4["tokens_kept_mean"] == ref["tokens_kept_mean"]
    # INT4 shrinks the payload of the same rows; dropping shrinks it further
    assert int4["payload_bytes_mean"] < ref["payload_bytes_mean"] / 4
    assert opt["payload_bytes_mean"] < int4["payload_bytes_mean"]
    # quantization really reaches the language model: close to the reference, not equal
    assert 0.5 < int4["logit_cosine_mean"] < 1.0 - 1e-6


def test_plot_writes_png(table: dict, tmp_path: Path) -> None:
    out = tmp_path / "encoder_vlm.png"
    plot_vlm([table], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_a_missing_checkpoint(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--out", str(tmp_path), "--vision-model", str(tmp_path / "nope")])
    assert info.value.code == 2
    assert "is not a directory" in capsys.readouterr().err


def test_cli_refuses_an_unsupported_vlm(tmp_path: Path, capsys) -> None:
    ckpt = tmp_path / "paligemma"
    ckpt.mkdir()
    config = {"model_type": "paligemma", "vision_config": {}, "text_config": {}}
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as info:
        main(["--out", str(tmp_path / "out"), "--vision-model", str(ckpt)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "paligemma" in err and "qwen2_5_vl" in err
