"""A message's `response.output_text.delta` frames, from one event encoded once.

Nearly every frame of a Realtime response is the next piece of its message's text. Those
events differ only in their `event_id` and `delta`: `TextDeltaFrames.of` encodes one with a
mark in each of the two fields, in the connection's (JSON) codec, and keeps the bytes around
the marks; `frame` puts a delta's event id and its text's JSON string between them. The result
is the UTF-8 payload that encoding the whole event gives, byte for byte. Event ids are the
sender's `event_000001`, ... (letters, digits and `_`: their JSON string is the id in quotes).
A msgpack connection, or an id that is one of the marks, gets no template (None): their events are
encoded whole.
"""

from __future__ import annotations

import msgspec

from gateway.api.realtime import protocol as rt

__all__ = ("TextDeltaFrames",)

_EID_MARK = "\x00\x01eid\x01\x00"
_TEXT_MARK = "\x00\x01text\x01\x00"
_json = msgspec.json.Encoder()
_EID_JSON = _json.encode(_EID_MARK)
_TEXT_JSON = _json.encode(_TEXT_MARK)
_encode_text = _json.encode


class TextDeltaFrames:
    """The text frames of one message (output item `output_index`, content part 0)."""

    __slots__ = ("_after", "_before", "_between")

    def __init__(self, before: bytes, between: bytes, after: bytes) -> None:
        self._before, self._between, self._after = before, between, after

    @classmethod
    def of(
        cls, codec: rt.WireCodec, response_id: str, item_id: str, output_index: int
    ) -> TextDeltaFrames | None:
        if codec.binary:
            return None
        event = rt.OutputTextDelta(_EID_MARK, response_id, item_id, output_index, 0, _TEXT_MARK)
        data = codec.encode(event)
        if data.count(_EID_JSON) != 1 or data.count(_TEXT_JSON) != 1:
            return None  # an id that is a mark: the parts could not be told apart
        before, _, rest = data.partition(_EID_JSON)
        between, found, after = rest.partition(_TEXT_JSON)
        if not found:  # the text before the event id: not the layout this fills in
            return None
        return cls(before, between, after)

    def frame(self, eid: str, text: str) -> bytes:
        """The JSON of the delta event `eid` carrying `text` (UTF-8)."""
        return b'%b"%b"%b%b%b' % (
            self._before,
            eid.encode(),
            self._between,
            _encode_text(text),
            self._after,
        )
