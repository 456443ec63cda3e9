"""A streamed chat completion's text frames, built from bytes encoded once per choice, are the
same bytes as the whole chunk encoded (`Frames.text`, `Frames.__call__`)."""

from __future__ import annotations

import json

import pytest

from gateway.api.openai.chat import protocol as p
from gateway.api.openai.chat.chunks import Frames

TEXTS = (
    "hi",
    " there",
    "",
    'quote " and \\ back',
    "line\nbreak\u2028",
    "é中🙂",
    "\x00\x01text\x01\x00",
)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", ["fake-echo", 'odd "model" \u0001'])
def test_text_frames_are_the_whole_chunk_encoded(include_usage: bool, model: str) -> None:
    frames = Frames("chatcmpl-1", 1700000000, model, "fp_1", include_usage)
    for index in (0, 3):
        for text in TEXTS:
            whole = frames._encode([p.ChunkChoice(index, p.Delta(content=text))], None, None)
            assert frames.text(index, text) == whole
            assert frames(index, p.Delta(content=text)) == whole
            chunk = json.loads(whole.removeprefix(b"data: "))
            assert chunk["choices"][0]["delta"]["content"] == text


def test_a_model_name_holding_the_mark_still_gets_exact_frames() -> None:
    frames = Frames("c", 1, "\x00\x01text\x01\x00", "fp", False)
    whole = frames._encode([p.ChunkChoice(0, p.Delta(content="a"))], None, None)
    assert frames.text(0, "a") == whole


def test_other_frames_are_encoded_whole() -> None:
    frames = Frames("c", 1, "m", "fp", False)
    role = frames(0, p.Delta(role="assistant", content=""))
    assert json.loads(role.removeprefix(b"data: "))["choices"][0]["delta"]["role"] == "assistant"
    end = frames(0, p.Delta(), finish_reason="stop")
    assert json.loads(end.removeprefix(b"data: "))["choices"][0]["finish_reason"] == "stop"
