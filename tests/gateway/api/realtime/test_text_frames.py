"""A plain answer's text frames from their template are the frames encoding each event gives."""

from __future__ import annotations

import asyncio

import pytest

from gateway.api.realtime import protocol as rt
from gateway.api.realtime.output import RealtimeResponseWriter
from gateway.api.realtime.text_frames import _EID_MARK, _TEXT_MARK, TextDeltaFrames
from gateway.chat.events import ResponseOptions, Started, TextChunk

TEXTS = ["hello", "", ' "quoted" ', "back\\slash", "tab\tnew\nline", "é 中文 🙂", "\x00\x1f", "</"]


@pytest.mark.parametrize(
    ("response_id", "item_id", "index"),
    [
        ("resp_1", "item_1", 0),
        ('resp "q"', "item\\x", 3),
        ("résp 🙂", "\x01", 12),
    ],
)
def test_frames_are_the_encoded_events(response_id: str, item_id: str, index: int) -> None:
    codec = rt.WireCodec()
    frames = TextDeltaFrames.of(codec, response_id, item_id, index)
    assert frames is not None
    for n, text in enumerate(TEXTS, start=1):
        eid = f"event_{n:06d}"
        whole = codec.encode(rt.OutputTextDelta(eid, response_id, item_id, index, 0, text))
        assert frames.frame(eid, text) == whole


def test_no_template_for_msgpack_or_an_id_that_is_a_mark() -> None:
    assert TextDeltaFrames.of(rt.WireCodec(binary=True), "resp_1", "item_1", 0) is None
    assert TextDeltaFrames.of(rt.WireCodec(), "resp_1", _TEXT_MARK, 0) is None
    assert TextDeltaFrames.of(rt.WireCodec(), _EID_MARK, "item_1", 0) is None


def _writer(
    codec: rt.WireCodec | None, sent: list[bytes]
) -> tuple[RealtimeResponseWriter, ResponseOptions]:
    seq = iter(range(1, 10_000))
    encode = rt.WireCodec(binary=codec.binary if codec else False).encode

    async def send(event: rt.ServerEvent) -> None:
        sent.append(encode(event))

    options = ResponseOptions(response_id="resp_x", item_id="item_x")
    writer = RealtimeResponseWriter(
        options,
        send=send,
        eid=lambda: f"event_{next(seq):06d}",
        conversation=None,
        metadata=None,
        model="m",
        codec=codec,
    )
    return writer, options


def test_writer_text_frames_match_its_events() -> None:
    async def run(codec: rt.WireCodec | None) -> tuple[list[bytes], list[str]]:
        sent: list[bytes] = []
        writer, options = _writer(codec, sent)
        await writer.on_event(Started(options.response_id, options.item_id))
        for text in TEXTS:
            frame = writer.text_frame(text)
            if frame is None:
                await writer.on_event(TextChunk(text))
            else:
                sent.append(frame)
        return sent, writer._text

    built, built_text = asyncio.run(run(None))
    framed, framed_text = asyncio.run(run(rt.WireCodec()))
    assert framed == built
    assert framed_text == built_text == TEXTS
    assert len(built) == 3 + len(TEXTS)  # created, item added, part added, then the deltas


def test_writer_without_template_builds_events() -> None:
    sent: list[bytes] = []
    writer, options = _writer(rt.WireCodec(binary=True), sent)
    asyncio.run(writer.on_event(Started(options.response_id, options.item_id)))
    assert writer.text_frame("x") is None
    json_writer, _ = _writer(rt.WireCodec(), [])
    assert json_writer.text_frame("x") is None  # no message open yet
