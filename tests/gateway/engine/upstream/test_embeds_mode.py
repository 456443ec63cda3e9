"""Embeds mode refuses at start what cannot work on the replica: an M-RoPE checkpoint with
patch dropping (vLLM places its visual tokens by the whole patch grid)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.engine.upstream.embeds_mode import embeds_problem, is_mrope_checkpoint
from gateway.engine.upstream.wire import grid_thw
from gateway.settings import Settings, SettingsError


def checkpoint(tmp_path: Path, model_type: str) -> Path:
    path = tmp_path / model_type
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


def settings(path: Path, pruning: str, images: str = "embeds") -> Settings:
    return Settings(
        engine="openai",
        upstreams=["http://127.0.0.1:9001"],
        upstream_images=images,
        model_path=str(path),
        pruning=pruning,
    )


@pytest.mark.parametrize("pruning", ["dynamic", "topk", "random", "dynamic+merge"])
def test_mrope_embeds_with_pruning_is_refused_at_start(tmp_path: Path, pruning: str) -> None:
    qwen = checkpoint(tmp_path, "qwen2_5_vl")
    with pytest.raises(SettingsError) as caught:
        settings(qwen, pruning)
    message = str(caught.value)
    assert message.startswith("VISIONGATE_PRUNING:")
    assert f"--pruning {pruning}" in message and "--pruning none" in message


def test_what_embeds_mode_accepts(tmp_path: Path) -> None:
    qwen = checkpoint(tmp_path, "qwen2_5_vl")
    llava = checkpoint(tmp_path, "llava")
    assert settings(qwen, "none").pruning == "none"
    # rows placed in order: any number of them is a valid prompt
    assert settings(llava, "dynamic").pruning == "dynamic"
    # the replica encodes the bytes itself: the gateway's pruning never reaches it
    assert settings(qwen, "dynamic", images="data_url").pruning == "dynamic"
    assert embeds_problem(tmp_path / "absent", "dynamic") is None  # the encoder's load says it
    assert is_mrope_checkpoint(qwen) and not is_mrope_checkpoint(llava)


def test_one_images_grid_is_one_dimensional() -> None:
    """vLLM stacks the items' grids into [images, 3]: each is [t, h, w], patches before the
    merge; a grid that does not match the rows (some were dropped) is None."""
    # 2 x 3 merged tokens (t, h, w per row)
    mrope = tuple(v for h in range(2) for w in range(3) for v in (0, h, w))
    assert grid_thw(mrope, 6, merge=2) == [1, 4, 6]
    assert grid_thw(mrope, 6, merge=1) == [1, 2, 3]
    assert grid_thw(mrope[:-3], 5, merge=2) is None
