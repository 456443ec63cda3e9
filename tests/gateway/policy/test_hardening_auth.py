"""Keys from headers and the Realtime subprotocol only, never echoed; URLs in spans without
query values; remote image URLs normalised before the allow-list sees them; the gateway and the
encoder accepting the same image formats. Over the real gateway with the fake engine/encoder."""

from __future__ import annotations

import asyncio
import io
import json

import httpx
import pytest
import websockets
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from encoder_worker.decode import ALLOWED_FORMATS, check_image
from encoder_worker.types import ImageError
from gateway.chat.image_input import sniff_image
from gateway.chat.remote_images import normalise_url, url_allowed
from gateway.policy.auth import QUERY_KEY_REFUSED, Authenticator, public_subprotocol
from gateway.protocol.errors import GatewayError, clip
from gateway.protocol.subprotocols import MSGPACK_SUBPROTOCOL
from gateway.telemetry import configure_logging
from gateway.telemetry._logging import scrub_secrets
from gateway.testing.images import data_url
from tests.conftest import photo_bytes

KEY = "sk-unit-3f9a1c77e2"
WRONG = "sk-wrong-8d02b4aa61"


def key_protocol(key: str) -> str:
    return f"openai-insecure-api-key.{key}"


# ------------------------------------------------------------------ pure parts


def test_clip_bounds_any_string() -> None:
    assert clip("short") == "short"
    assert clip("x" * 200) == "x" * 200
    clipped = clip("y" * 1_000_000)
    assert clipped.startswith("y" * 200 + "...") and clipped.endswith("(1000000 chars)")
    assert len(clipped) < 230
    assert clip("abcdef", limit=3) == "abc... (6 chars)"


@pytest.mark.parametrize(
    "url, normal",
    [
        ("HTTP://Img.Example.COM:80/a/b.png", "http://img.example.com/a/b.png"),
        ("https://img.example.com:443/a.png", "https://img.example.com/a.png"),
        ("http://img.example.com:8080/a.png", "http://img.example.com:8080/a.png"),
        ("http://img.example.com", "http://img.example.com/"),
        ("http://img.example.com./a.png", "http://img.example.com/a.png"),
        ("http://h/ok/../secret.png", "http://h/secret.png"),
        ("http://h/ok/%2e%2E/secret.png", "http://h/secret.png"),
        ("http://h/ok/./a/.", "http://h/ok/a/"),
        ("http://h/%7euser/%41%2a.png", "http://h/~user/A%2A.png"),
        ("http://h/caf%c3%a9/é.png", "http://h/caf%C3%A9/%C3%A9.png"),
        ("http://h/a.png?x=%7e&y=1#frag", "http://h/a.png?x=~&y=1"),
        ("http://[::1]:80/a.png", "http://[::1]/a.png"),
    ],
)
def test_urls_are_normalised(url: str, normal: str) -> None:
    assert str(normalise_url(url)) == normal


@pytest.mark.parametrize(
    "url, why",
    [
        ("http://user:pw@h/a.png", "user info"),
        ("http://allowed.example@evil.example/a.png", "user info"),
        ("http://h/ok/..%2fsecret.png", "encoded slash"),
        ("http://h/ok%2F..%2Fsecret.png", "encoded slash"),
        ("http://h/ok/..%5csecret.png", "encoded slash"),
        ("http://h/ok/%252e%252e/secret.png", "double-encoded"),
        ("http://h/a%00.png", "NUL"),
        ("http://h/ok/..;/secret.png", "parameters"),
        ("http://h/ok//../secret.png", "empty and dot"),
        ("http://h/../secret.png", "above the root"),
        ("http://h/ok\\..\\secret.png", "backslash"),
        ("http://h/a b.png", "whitespace"),
        ("http://h/a\tb.png", "control"),
        ("http://h/%zz.png", "percent-escape"),
        ("http://h:99999/a.png", "port"),
        ("http://ex%61mple.com/a.png", "invalid host"),
        ("ftp://h/a.png", "http or https"),
    ],
)
def test_ambiguous_urls_are_refused(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        normalise_url(url)


def test_allow_list_compares_parsed_parts_on_segment_boundaries() -> None:
    entries = [
        normalise_url("http://Img.Example:80/ok/"),
        normalise_url("https://cdn.example/pics"),
    ]

    def allowed(url: str) -> bool:
        return url_allowed(normalise_url(url), entries)

    assert allowed("http://img.example/ok/a.png")
    assert allowed("HTTP://IMG.EXAMPLE:80/ok/sub/a.png")
    assert not allowed("http://img.example/okay/a.png")
    assert not allowed("http://img.example/ok")  # the entry is the directory /ok/
    assert not allowed("https://img.example/ok/a.png")  # another scheme
    assert not allowed("http://img.example:8080/ok/a.png")  # another port
    assert not allowed("http://img.example.evil/ok/a.png")
    assert not allowed("http://img.example/ok/../secret.png")
    assert allowed("https://cdn.example/pics") and allowed("https://cdn.example/pics/a.png")
    assert not allowed("https://cdn.example/pictures/a.png")


def test_keys_come_from_headers_or_the_subprotocol() -> None:
    auth = Authenticator([KEY])
    owner = auth.owner({"authorization": f"Bearer {KEY}"})
    assert owner.startswith("key_") and KEY not in owner
    assert auth.owner({"authorization": f"bearer  {KEY} "}) == owner
    assert auth.owner({}, ["realtime", key_protocol(KEY)]) == owner
    for headers, protocols in (
        ({}, []),
        ({}, ["realtime", key_protocol(WRONG)]),
        ({}, [f"api_key={KEY}"]),
        ({"authorization": f"Basic {KEY}"}, []),
        ({"authorization": f"Bearer {WRONG}"}, [key_protocol(KEY)]),  # the header decides
    ):
        with pytest.raises(GatewayError) as err:
            auth.owner(headers, protocols)
        assert err.value.code == "unauthorized" and KEY not in err.value.message
    assert Authenticator([]).owner({}, [key_protocol(WRONG)]) == "anonymous"


def test_the_accepted_subprotocol_never_carries_a_key() -> None:
    assert public_subprotocol(["realtime", key_protocol(KEY)]) == "realtime"
    assert public_subprotocol([key_protocol(KEY), MSGPACK_SUBPROTOCOL, "realtime"]) == (
        MSGPACK_SUBPROTOCOL
    )
    assert public_subprotocol([key_protocol(KEY)]) is None
    assert public_subprotocol([]) is None


def test_log_lines_are_scrubbed() -> None:
    event = scrub_secrets(
        None,
        "info",
        {
            "event": f'127.0.0.1:5 - "WebSocket /v1/realtime?session_id=s&api_key={KEY}" 403',
            "header": f"< Sec-WebSocket-Protocol: realtime, {key_protocol(KEY)}",
            "auth": f"< Authorization: Bearer {KEY}",
            "authorization": KEY,
            "nested": {"api_key": KEY, "ok": ["z" * 5000]},
            "count": 3,
        },
    )
    text = json.dumps(event)
    assert KEY not in text and "[redacted]" in event["header"]
    assert event["event"].endswith('api_key=[redacted]" 403') and "session_id=s" in event["event"]
    assert event["nested"]["ok"][0].endswith("(5000 chars)") and event["count"] == 3


def test_managed_and_ephemeral_secrets_are_scrubbed_by_their_form() -> None:
    from gateway.policy.client_secrets import new_client_secret
    from gateway.policy.key_store import new_secret

    managed, ephemeral = new_secret(), new_client_secret()  # never registered with the scrubber
    cut = ephemeral[:12]  # a secret the clip cut short
    event = scrub_secrets(
        None,
        "info",
        {
            "event": f'"WebSocket /v1/realtime?session_id={ephemeral}" 403',
            "header": f"< Sec-WebSocket-Protocol: realtime, {key_protocol(ephemeral)}",
            "model": managed,
            "message": f"unknown model 'x{managed}' or session _{ephemeral}",
            "nested": {"items": [f"({managed})", {"path": f"/v1/sessions/{ephemeral}"}]},
            "edge": "y" * 490 + ephemeral,
            "short": f"prefix {cut}",
            # what is not a secret stays: names that merely hold the letters
            "plain": "check_model vgk- ek_ week_ai grok_4 ek_ab",
        },
    )
    text = json.dumps(event)
    for secret in (managed, ephemeral, managed[4:], ephemeral[3:], cut[3:]):
        assert secret not in text, secret
    assert event["model"] == "vgk-[redacted]"
    assert event["nested"]["items"][1]["path"] == "/v1/sessions/ek_[redacted]"
    assert event["plain"] == "check_model vgk- ek_ week_ai grok_4 ek_ab"


def test_json_tracebacks_carry_no_key_and_no_locals() -> None:
    import logging

    buf = io.StringIO()
    configure_logging("info", json=True, stream=buf)
    try:
        secret_local = KEY  # noqa: F841 - a local the traceback must not show
        raise ValueError(f"bad header Bearer {KEY} " + "q" * 100_000)
    except ValueError:
        logging.getLogger("visiongate.test").exception("failed")
    finally:
        configure_logging("warning", json=True)
    line = buf.getvalue()
    assert "failed" in line and "ValueError" in line
    assert KEY not in line and "q" * 1000 not in line and len(line) < 30_000


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "PPM", "ICO", "PCX"])
def test_gateway_and_encoder_accept_the_same_formats(fmt: str) -> None:
    data = photo_bytes("chelsea", fmt=fmt, size=64)
    try:
        check_image(data, 10**7, 10**7)
        encoder_code = None
    except ImageError as exc:
        encoder_code = exc.code
    try:
        sniff_image(data, max_bytes=10**7, max_pixels=10**7)
        gateway_code = None
    except GatewayError as exc:
        gateway_code = exc.code
    assert (gateway_code is None) == (encoder_code is None) == (fmt in ALLOWED_FORMATS)
    if fmt == "TIFF":
        assert gateway_code == encoder_code == "unsupported_image_format"


def test_a_damaged_allowed_image_is_invalid_not_unsupported() -> None:
    jpeg = photo_bytes("chelsea", size=64)
    # a cut JPEG, and bytes too short for some plugins' signature checks (struct.error inside)
    for data in (jpeg[:20], b"\0\0\0", b"BM", b""):
        with pytest.raises(GatewayError) as err:
            sniff_image(data, max_bytes=10**6, max_pixels=10**6)
        assert err.value.code == "invalid_image", data


# ------------------------------------------------------------------ over a real server


@pytest.fixture
def keyed(make_gateway):
    return make_gateway(settings=dict(api_keys=[KEY]))


async def test_subprotocol_key_is_accepted_and_never_echoed(keyed) -> None:
    async with websockets.connect(keyed.ws_url, subprotocols=["realtime", key_protocol(KEY)]) as ws:
        assert ws.subprotocol == "realtime"
        assert ws.response.headers["Sec-WebSocket-Protocol"] == "realtime"
        assert KEY not in str(ws.response.headers)
        assert json.loads(await ws.recv())["type"] == "session.created"
    async with websockets.connect(
        keyed.ws_url, subprotocols=[MSGPACK_SUBPROTOCOL, key_protocol(KEY)]
    ) as ws:
        assert ws.subprotocol == MSGPACK_SUBPROTOCOL
        assert isinstance(await ws.recv(), bytes)  # the msgpack codec was chosen


async def test_unknown_subprotocol_key_is_refused_at_the_handshake(keyed) -> None:
    with pytest.raises(websockets.InvalidStatus) as refused:
        await websockets.connect(keyed.ws_url, subprotocols=["realtime", key_protocol(WRONG)])
    assert refused.value.response.status_code == 403
    assert WRONG not in str(refused.value.response.headers)


@pytest.mark.parametrize("protocols", [None, ["realtime", key_protocol(KEY)]])
async def test_key_in_the_query_is_refused_with_a_reason(keyed, protocols) -> None:
    # even a valid key: it has already been written into a URL
    async with websockets.connect(f"{keyed.ws_url}?api_key={KEY}", subprotocols=protocols) as ws:
        assert ws.subprotocol == (protocols and "realtime")
        with pytest.raises(websockets.ConnectionClosedError) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd.code == 1008 and closed.value.rcvd.reason == QUERY_KEY_REFUSED


async def test_key_in_the_query_is_refused_without_keys_configured(fake_gateway) -> None:
    async with websockets.connect(f"{fake_gateway.ws_url}?api_key=anything") as ws:
        with pytest.raises(websockets.ConnectionClosedError) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd.code == 1008


def test_http_takes_the_bearer_header_only(keyed) -> None:
    url = f"{keyed.http_url}/v1/models"
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    for request in (
        dict(params={"api_key": KEY}),
        dict(headers={"Authorization": f"Bearer {WRONG}"}),
        dict(headers={"Sec-WebSocket-Protocol": key_protocol(KEY)}),
    ):
        refused = httpx.get(url, **request)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
        assert KEY not in refused.text


async def test_spans_hold_no_query_values_and_no_raw_paths(keyed) -> None:
    exporter = InMemorySpanExporter()
    keyed.state.telemetry.tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    auth = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=keyed.http_url) as client:
        assert (await client.get("/v1/models", params={"api_key": KEY}, headers=auth)).is_success
        long_id = "s" * 5000
        assert (await client.get(f"/v1/sessions/{long_id}", headers=auth)).status_code == 404
    for _ in range(1000):  # a server span ends just after its response is sent
        if len(exporter.get_finished_spans()) >= 2:
            break
        await asyncio.sleep(0.01)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert "GET /v1/models" in spans and "GET /v1/sessions/{session_id}" in spans, list(spans)
    url = spans["GET /v1/models"].attributes.get("http.url", "")
    assert url.endswith("/v1/models?api_key=[redacted]"), url
    for span in spans.values():
        for value in span.attributes.values():
            assert KEY not in str(value) and len(str(value)) < 300, value


async def test_tiff_is_refused_at_the_gateway_on_http_and_websocket(make_gateway) -> None:
    gateway = make_gateway()
    tiff = photo_bytes("chelsea", fmt="TIFF", size=64)
    tiff_url = data_url(tiff, "image/tiff")

    async with httpx.AsyncClient(base_url=gateway.http_url) as client:
        upload = await client.post(
            "/v1/images", content=tiff, headers={"Content-Type": "image/tiff"}
        )
        assert upload.status_code == 415, upload.text
        assert upload.json()["error"]["code"] == "unsupported_image_format"
        chat = await client.post(
            "/v1/chat/completions",
            json={
                "model": "fake-echo",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": tiff_url}}],
                    }
                ],
            },
        )
        assert chat.status_code == 415, chat.text
        assert chat.json()["error"]["code"] == "unsupported_image_format"
    async with websockets.connect(gateway.ws_url, max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "event_id": "tiff",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": tiff_url}],
                    },
                }
            )
        )
        error = json.loads(await asyncio.wait_for(ws.recv(), 10))
    assert error["type"] == "error", error
    assert error["error"]["code"] == "unsupported_image_format"
    assert error["error"]["event_id"] == "tiff"
    assert gateway.encoder.encoded == []  # refused before the encoder saw it
