"""A key whose large bodies keep being refused gets its large bodies and frames refused unread
(gateway/api/http/body_guard.py), over a real gateway on loopback; other keys are untouched."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from types import SimpleNamespace

import httpx
import pytest
import websockets

from gateway.api.http import bodies
from gateway.api.http.body_guard import BodyGuard
from gateway.policy.auth import Authenticator
from gateway.policy.ratelimit import SMALL_BODY, RefusedBytes
from gateway.testing.clock import ManualClock
from gateway.testing.fake_gateway import GatewayFactory, MiB
from gateway.testing.images import data_url


def test_refused_bytes_is_a_sliding_minute_per_owner() -> None:
    clock = ManualClock(100.0)
    refused = RefusedBytes(10, clock=clock)
    refused.add("a", 4)  # counted in the second ending at 101
    clock.now += 20
    refused.add("a", 4)
    assert refused.retry_after("a") is None  # 8 < 10
    clock.now += 10
    refused.add("a", 4)
    refused.add("b", 3)
    assert refused.total("a") == 12 and refused.total("b") == 3
    # below the limit again once the first 4 bytes leave the window (at 101 + 60)
    assert refused.retry_after("a") == pytest.approx(31.0)
    assert refused.retry_after("b") is None
    clock.now += 30.5
    assert refused.retry_after("a") == pytest.approx(0.5)  # never early
    clock.now += 0.5
    assert refused.retry_after("a") is None and refused.total("a") == 8
    clock.now += 61
    assert refused.total("a") == 0 and refused.total("b") == 0
    assert not refused._owners  # an owner's record goes with its last event
    refused.add("a", 0)
    assert not refused._owners
    assert RefusedBytes(0, clock=clock).retry_after("a") is None  # 0: off
    clock.now = 500.25
    for _ in range(1000):  # a clock second's refusals are one entry
        clock.now += 0.0005
        refused.add("c", 1)
    assert len(refused._owners["c"][0]) == 1 and refused.total("c") == 1000


def _chat_body(model: str, image: bytes, text: str = "what is this?") -> bytes:
    part = {"type": "image_url", "image_url": {"url": data_url(image)}}
    return json.dumps(
        {
            "model": model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}, part]}],
        }
    ).encode()


def _rate_limited_count(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    found = re.search(r'visiongate_errors_total\{[^}]*code="rate_limited"[^}]*\} ([0-9.e+]+)', text)
    return float(found.group(1)) if found else 0.0


def _post(client: httpx.Client, key: str, body: bytes) -> httpx.Response:
    return client.post(
        "/v1/chat/completions",
        content=body,
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
    )


def test_a_key_refused_too_often_is_refused_unread(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(
        settings=dict(
            api_keys=["key-a", "key-b"],
            max_image_bytes=2 * MiB,
            max_refused_body_bytes_per_minute=5 * MiB,
        )
    )
    model = gateway.engine.model_id
    too_large = _chat_body(model, b"\xff\xd8\xff\xe0" + bytes(2 * MiB + 1024))  # ~2.8 MB
    assert len(too_large) > SMALL_BODY
    with httpx.Client(base_url=gateway.http_url, timeout=30) as client:
        before = _rate_limited_count(client)
        # two refusals as too large: 5.6 MB read and refused, past the 5 MiB a minute
        for _ in range(2):
            r = _post(client, "key-a", too_large)
            assert r.status_code == 413 and r.json()["error"]["code"] == "image_too_large"
        engine_calls = len(gateway.engine.requests)
        r = _post(client, "key-a", too_large)
        assert r.status_code == 429, r.text
        error = r.json()["error"]
        assert error["code"] == "rate_limited" and error["type"] == "rate_limit_error"
        assert "key-a" not in r.text
        assert 1 <= int(r.headers["retry-after"]) <= 61  # a minute, counted by whole seconds
        assert r.headers.get("x-request-id", "").startswith("req_")
        assert r.headers.get("connection") != "close"  # the body was drained: kept alive
        # a large body that would have been served is refused too: it is not read
        fine_but_large = _chat_body(model, bytes(1536 * 1024))
        assert len(fine_but_large) > SMALL_BODY
        assert _post(client, "key-a", fine_but_large).status_code == 429
        # small bodies are read and served as before: the key can still chat
        small = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        r = client.post(
            "/v1/chat/completions", json=small, headers={"authorization": "Bearer key-a"}
        )
        assert r.status_code == 200, r.text
        assert len(gateway.engine.requests) == engine_calls + 1  # nothing of the 429s ran
        # another key's large bodies are still read: its own 413, then a served request
        r = _post(client, "key-b", too_large)
        assert r.status_code == 413 and r.json()["error"]["code"] == "image_too_large"
        r = _post(client, "key-b", fine_but_large)
        assert r.status_code != 429
        # a refused key's unauthenticated twin is still the app's 401, never the guard's 429
        r = _post(client, "wrong", too_large)
        assert r.status_code == 401
        assert _rate_limited_count(client) == before + 2
        assert client.get("/healthz").status_code == 200


def test_a_chunked_body_of_a_refused_key_is_never_read(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway(
        settings=dict(api_keys=["key-a"], max_refused_body_bytes_per_minute=1 * MiB)
    )
    model = gateway.engine.model_id
    too_large = _chat_body(model, b"\xff\xd8\xff\xe0" + bytes(2 * MiB + 1024))
    with httpx.Client(base_url=gateway.http_url, timeout=30) as client:
        assert _post(client, "key-a", too_large).status_code == 413
        before = _rate_limited_count(client)

        def chunks():  # no Content-Length: its size is unknown until read
            yield b'{"model": "' + model.encode() + b'", "messages": []}'

        r = client.post(
            "/v1/chat/completions",
            content=chunks(),
            headers={"authorization": "Bearer key-a", "content-type": "application/json"},
        )
        assert r.status_code == 429 and r.headers.get("connection") == "close"
        assert _rate_limited_count(client) == before + 1
        assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize(
    "settings",
    [
        dict(api_keys=["key-a"], max_refused_body_bytes_per_minute=0),  # turned off
        dict(max_refused_body_bytes_per_minute=1 * MiB),  # no keys: one owner, off
    ],
    ids=["setting-off", "no-api-keys"],
)
def test_the_guard_can_be_off(make_gateway: GatewayFactory, settings: dict) -> None:
    gateway = make_gateway(settings=settings)
    too_large = _chat_body(gateway.engine.model_id, b"\xff\xd8\xff\xe0" + bytes(2 * MiB + 1024))
    with httpx.Client(base_url=gateway.http_url, timeout=30) as client:
        for _ in range(4):
            r = _post(client, "key-a", too_large)
            assert r.status_code == 413, r.text


async def test_websocket_frames_count_and_are_refused_undecoded(
    make_gateway: GatewayFactory,
) -> None:
    gateway = make_gateway(
        settings=dict(
            api_keys=["key-a", "key-b"],
            max_image_bytes=2 * MiB,
            max_refused_body_bytes_per_minute=5 * MiB,
        )
    )
    url = data_url(bytes(2 * MiB + 1024))

    def item(n: int, content: list[dict]) -> str:
        event = {"type": "conversation.item.create", "event_id": f"e{n}"}
        event["item"] = {"type": "message", "role": "user", "content": content}
        return json.dumps(event)

    too_large = item(0, [{"type": "input_image", "image_url": url}])
    assert len(too_large) > SMALL_BODY
    auth = {"Authorization": "Bearer key-a"}
    async with websockets.connect(gateway.ws_url, additional_headers=auth, max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"

        async def answer() -> dict:
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), 10))
                if event["type"] in ("error", "conversation.item.added"):
                    return event

        for _ in range(2):
            await ws.send(too_large)
            error = (await answer())["error"]
            assert error["code"] == "image_too_large" and error["event_id"] == "e0"
        await ws.send(too_large)
        error = (await answer())["error"]
        assert error["code"] == "rate_limited" and error["event_id"] is None
        # frames are sized in bytes: 400k three-byte characters are a large frame
        await ws.send(item(2, [{"type": "input_text", "text": "\u20ac" * 400_000}]))
        assert (await answer())["error"]["code"] == "rate_limited"
        # small frames are decoded as before, on the same connection
        await ws.send(item(1, [{"type": "input_text", "text": "hello"}]))
        assert (await answer())["type"] == "conversation.item.added"
    # HTTP shares the key's count: its large bodies are refused unread too
    with httpx.Client(base_url=gateway.http_url, timeout=30) as client:
        r = _post(client, "key-a", _chat_body(gateway.engine.model_id, bytes(1536 * 1024)))
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
        r = _post(client, "key-b", _chat_body("no-such-model", bytes(1536 * 1024)))
        assert r.status_code == 404  # another key: read, and refused for what it says


def _raw(gateway, head: str, body: bytes = b"") -> bytes:
    """Send one request as raw bytes; the whole answer (the server closes or it is complete)."""
    host, port = gateway.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def _length(data: bytes) -> int:
    found = re.search(rb"content-length: *(\d+)", data.partition(b"\r\n\r\n")[0], re.I)
    return int(found.group(1)) if found else 1 << 30


def _chunked(body: bytes, size: int = 65536) -> bytes:
    parts = [
        b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size])
        for i in range(0, len(body), size)
    ]
    return b"".join(parts) + b"0\r\n\r\n"


def test_bodies_the_guard_cannot_size_or_authenticate_are_not_decoded(
    make_gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[int] = []  # every JSON body the app reads in full
    real = bodies.check_json_values
    monkeypatch.setattr(
        bodies, "check_json_values", lambda b, *a: (decoded.append(len(b)), real(b, *a))[1]
    )
    gateway = make_gateway(
        settings=dict(
            api_keys=["key-a", "key-b"],
            max_image_bytes=2 * MiB,
            max_refused_body_bytes_per_minute=5 * MiB,
        )
    )
    too_large = _chat_body(gateway.engine.model_id, b"\xff\xd8\xff\xe0" + bytes(2 * MiB + 1024))
    # no key, or a wrong one: 401 from the headers, the body drained but never decoded
    with httpx.Client(base_url=gateway.http_url, timeout=30) as client:
        for key in ("wrong", None):
            headers = {"content-type": "application/json"}
            if key:
                headers["authorization"] = f"Bearer {key}"
            r = client.post("/v1/chat/completions", content=too_large, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert decoded == []
    # Content-Length beside chunked framing: the length is unknown, so the body is counted
    head = (
        "POST /v1/chat/completions HTTP/1.1\nHost: x\nAuthorization: Bearer key-a\n"
        "Content-Type: application/json\nContent-Length: 1\nTransfer-Encoding: chunked\n"
    )
    for _ in range(2):
        answer = _raw(gateway, head, _chunked(too_large))
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert gateway.state.refused.total(bodies_owner(gateway, "key-a")) >= 2 * len(too_large)
    answer = _raw(gateway, head, _chunked(too_large))
    assert answer.startswith(b"HTTP/1.1 429") and b"connection: close" in answer.lower()
    # a boxed key that waits for 100 Continue is answered at once, with no invitation to send
    head = (
        "POST /v1/chat/completions HTTP/1.1\nHost: x\nAuthorization: Bearer key-a\n"
        f"Content-Type: application/json\nContent-Length: {len(too_large)}\n"
        "Expect: 100-continue\n"
    )
    answer = _raw(gateway, head)
    assert answer.startswith(b"HTTP/1.1 429") and b"100 Continue" not in answer
    assert len(decoded) == 2  # the two counted bodies, nothing else


def bodies_owner(gateway, key: str) -> str:
    return gateway.state.auth.owner({"authorization": f"Bearer {key}"})


async def test_a_burst_of_a_refused_keys_bodies_is_read_one_at_a_time(
    make_gateway: GatewayFactory,
) -> None:
    gateway = make_gateway(
        settings=dict(
            api_keys=["key-a"], max_image_bytes=2 * MiB, max_refused_body_bytes_per_minute=5 * MiB
        )
    )
    too_large = _chat_body(gateway.engine.model_id, b"\xff\xd8\xff\xe0" + bytes(2 * MiB + 1024))
    headers = {"authorization": "Bearer key-a", "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=60) as client:
        r = await client.post("/v1/chat/completions", content=too_large, headers=headers)
        assert r.status_code == 413  # one refusal on record: 2.8 of 5 MiB
        burst = await asyncio.gather(
            *(
                client.post("/v1/chat/completions", content=too_large, headers=headers)
                for _ in range(8)
            )
        )
    codes = sorted(r.status_code for r in burst)
    # one more is read (the total passes the limit), the other seven are not
    assert codes == [413] + [429] * 7, codes


# -- the guard alone, over stand-in apps (what a real app rarely does: raise, stall, lose its
# client) ------------------------------------------------------------------------------------


class _Metrics:
    def record_error(self, **_: object) -> None:
        pass


def _guard(app) -> tuple[BodyGuard, str]:
    auth = Authenticator(["key-a"])
    state = SimpleNamespace(auth=auth, refused=RefusedBytes(64 * MiB), metrics=_Metrics())
    owner = auth.owner({"authorization": "Bearer key-a"})
    state.refused.add(owner, 1)  # a refusal on record: large bodies take turns
    return BodyGuard(app, state), owner  # type: ignore[arg-type]


def _scope() -> dict:
    headers = [(b"authorization", b"Bearer key-a"), (b"content-length", b"%d" % (2 * MiB))]
    return {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}


def _body_then_disconnect():
    sent = [{"type": "http.request", "body": bytes(2 * MiB), "more_body": False}]

    async def receive() -> dict:
        if sent:
            return sent.pop()
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    return receive


async def _nowhere(message: dict) -> None:
    pass


async def test_an_app_that_raises_passes_the_turn_on_once() -> None:
    started = asyncio.Event()

    async def app(scope, receive, send) -> None:
        await receive()
        if scope["path"] == "/late":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            started.set()
            await asyncio.sleep(0.05)
        raise ValueError("the app failed")

    guard, _ = _guard(app)
    with pytest.raises(ValueError):  # not a lock error in its place
        await guard(_scope(), _body_then_disconnect(), _nowhere)
    assert not guard._turns._lines
    # raising after its answer started, while another request waits for the turn
    first = asyncio.create_task(
        guard({**_scope(), "path": "/late"}, _body_then_disconnect(), _nowhere)
    )
    await started.wait()
    second = asyncio.create_task(guard(_scope(), _body_then_disconnect(), _nowhere))
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert [type(r) for r in results] == [ValueError, ValueError]
    assert not guard._turns._lines


async def test_a_served_request_holds_the_turn_briefly() -> None:
    entered: list[float] = []

    async def app(scope, receive, send) -> None:
        entered.append(asyncio.get_running_loop().time())
        await receive()
        await asyncio.sleep(2.0)  # encoding, then the first token: the answer starts late
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard, _ = _guard(app)
    await asyncio.gather(*(guard(_scope(), _body_then_disconnect(), _nowhere) for _ in range(2)))
    assert entered[1] - entered[0] < 1.5  # HANDOFF_S after the first body, not after its answer
    assert not guard._turns._lines


async def test_a_client_that_went_away_is_not_counted() -> None:
    async def app(scope, receive, send) -> None:
        await receive()
        assert (await receive())["type"] == "http.disconnect"
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard, owner = _guard(app)
    messages = [
        {"type": "http.disconnect"},
        {"type": "http.request", "body": bytes(2 * MiB), "more_body": False},
    ]

    async def receive() -> dict:
        return messages.pop()

    await guard(_scope(), receive, _nowhere)
    assert guard.refused.total(owner) == 1  # only the refusal on record before
