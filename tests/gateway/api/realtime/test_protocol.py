from __future__ import annotations

import msgspec
import pytest

from gateway.api.realtime import protocol as rt
from gateway.chat.image_input import ImageRef, parse_image_url, sniff_image
from gateway.protocol.errors import GatewayError
from tests.conftest import photo_bytes


@pytest.mark.parametrize("binary", [False, True])
def test_client_events_decode_with_unknown_fields_ignored(binary: bool) -> None:
    codec = rt.WireCodec(binary=binary)
    enc = msgspec.msgpack.encode if binary else msgspec.json.encode
    event = codec.decode(
        enc(
            {
                "type": "conversation.item.create",
                "event_id": "e",
                "item": {
                    "type": "message",
                    "role": "user",
                    "object": "realtime.item",
                    "future_field": 1,
                    "content": [{"type": "input_text", "text": "hi"}],
                },
            }
        )
    )
    assert isinstance(event, rt.ConversationItemCreate)
    assert event.item.content[0].text == "hi" and event.event_id == "e"
    assert isinstance(codec.decode(enc({"type": "response.cancel"})), rt.ResponseCancel)


@pytest.mark.parametrize(
    "frame, code, param, event_id",
    [
        (b"{", "invalid_json", None, None),
        (b'{"type":"input_audio_buffer.append","event_id":"a"}', "unknown_event", "type", "a"),
        (b'{"event_id":"b"}', "invalid_event", "type", "b"),
        (
            b'{"type":"session.update","event_id":"c","session":{"temperature":"hot"}}',
            "invalid_event",
            "session.temperature",
            "c",
        ),
        (
            b'{"type":"conversation.item.create","item":{"type":"message","role":"robot",'
            b'"content":[]}}',
            "invalid_event",
            "item.role",
            None,
        ),
        (  # items are a union on `type`: one without it is no item at all
            b'{"type":"conversation.item.create","item":{"role":"user","content":[]}}',
            "invalid_event",
            "item",
            None,
        ),
        (
            b'{"type":"conversation.item.create","item":{"type":"function_call_output",'
            b'"output":"21C"}}',
            "invalid_event",
            "item",
            None,
        ),
    ],
)
def test_bad_frames_classified(
    frame: bytes, code: str, param: str | None, event_id: str | None
) -> None:
    with pytest.raises(GatewayError) as err:
        rt.WireCodec().decode(frame)
    assert err.value.code == code
    assert err.value.param == param
    assert err.value.event_id == event_id


def test_server_events_encode_in_realtime_shape() -> None:
    ev = rt.ErrorEvent(
        "event_1",
        rt.ErrorBody(
            type="invalid_request_error", code="invalid_json", message="bad", event_id="x"
        ),
    )
    out = msgspec.json.decode(rt.WireCodec().encode(ev))
    assert out == {
        "type": "error",
        "event_id": "event_1",
        "error": {
            "type": "invalid_request_error",
            "code": "invalid_json",
            "message": "bad",
            "param": None,
            "event_id": "x",
        },
    }


def test_image_urls() -> None:
    jpeg = photo_bytes("rocket", size=64)
    import base64

    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    assert parse_image_url(url, max_bytes=10**6) == jpeg
    ref = parse_image_url("visiongate:sha256:" + "a" * 64, max_bytes=10)
    assert isinstance(ref, ImageRef) and ref == "a" * 64
    for bad, code in [
        ("https://example.com/a.jpg", "invalid_image"),
        ("data:image/jpeg,rawbytes", "invalid_image"),
        ("data:text/plain;base64,aGk=", "unsupported_image_format"),
        ("visiongate:sha256:xyz", "invalid_image"),
        ("data:image/png;base64,!!!", "invalid_image"),
        (url, "image_too_large"),
    ]:
        with pytest.raises(GatewayError) as err:
            parse_image_url(bad, max_bytes=100)
        assert err.value.code == code, bad
    assert sniff_image(jpeg, max_bytes=10**6, max_pixels=10**6) == ("JPEG", 64, 64)
    with pytest.raises(GatewayError) as err:
        sniff_image(jpeg, max_bytes=10**6, max_pixels=1000)
    assert err.value.code == "image_too_large"
    with pytest.raises(GatewayError) as err:
        sniff_image(jpeg[:20], max_bytes=10**6, max_pixels=10**6)
    assert err.value.code == "invalid_image"
