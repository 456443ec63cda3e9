"""StreamDecoder and sampling without a model: UTF-8 safety, stop strings, top-p."""

from __future__ import annotations

from pathlib import Path

import torch

from gateway.engine.local.generation import StreamDecoder, sample_next
from gateway.engine.local.weights import cache_root


def byte_decoder(stops=()) -> StreamDecoder:
    # ids are raw bytes: a multi-byte character arrives split over several ids
    return StreamDecoder(lambda ids: bytes(ids).decode("utf-8", errors="replace"), stops)


def feed(decoder: StreamDecoder, text: str) -> list[str]:
    out = [decoder.push(b) for b in text.encode()]
    out.append(decoder.finish())
    return [d for d in out if d]


def test_never_emits_broken_utf8() -> None:
    text = "héllo 🐉 wörld"
    decoder = byte_decoder()
    deltas = feed(decoder, text)
    assert "".join(deltas) == text == decoder.text
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_is_not_emitted_and_prefix_is_held_back() -> None:
    decoder = byte_decoder(("STOP",))
    emitted = []
    for b in b"abc STO":
        emitted.append(decoder.push(b))
    assert "".join(emitted) == "abc "  # "STO" might become the stop string
    assert decoder.push(ord("P")) == ""
    assert decoder.stopped and decoder.text == "abc "
    assert decoder.finish() == ""


def test_held_back_prefix_is_released_when_it_diverges() -> None:
    decoder = byte_decoder(("STOP",))
    deltas = feed(decoder, "a ST b STX")
    assert "".join(deltas) == "a ST b STX" and not decoder.stopped


def test_earliest_of_several_stops_wins() -> None:
    decoder = byte_decoder(("world", "lo w"))
    deltas = feed(decoder, "hello world")
    assert "".join(deltas) == decoder.text == "hel"


def test_sampling_greedy_and_top_p() -> None:
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    assert sample_next(logits, 0.0, 1.0, None) == 1
    g = torch.Generator().manual_seed(0)
    picks = {sample_next(logits, 1.0, 0.5, g) for _ in range(50)}
    assert picks == {1}  # top-p 0.5 keeps only the most likely token
    g = torch.Generator().manual_seed(0)
    picks = {sample_next(logits, 1.0, 0.99, g) for _ in range(200)}
    assert picks <= {1, 2, 0} and {1, 2} <= picks
    a = [sample_next(logits, 1.0, 1.0, torch.Generator().manual_seed(7)) for _ in range(5)]
    b = [sample_next(logits, 1.0, 1.0, torch.Generator().manual_seed(7)) for _ in range(5)]
    assert a == b


def test_cache_root_is_the_setting_passed_in(monkeypatch, tmp_path) -> None:
    from gateway.settings import Settings

    # VISIONGATE_CACHE_DIR reaches the weights through the settings, not the environment
    settings = Settings.load(environ={"VISIONGATE_CACHE_DIR": str(tmp_path / "env")})
    assert cache_root(settings.cache_dir) == tmp_path / "env"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.setenv("VISIONGATE_CACHE_DIR", str(tmp_path / "ignored"))
    assert cache_root() == Path.home() / ".cache" / "visiongate"
