"""Slow and idle clients against a real gateway on loopback sockets (fake engine): heads that
never end, bodies trickled a byte at a time, floods of connections and upgrades the app never
answers. Each is cut off or refused with a clear status, counted in
`visiongate_connections_refused_total`, while a normal client is still served at once."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from litestar import Litestar, WebSocket, websocket

from gateway.server.connection_guard import HEAD_GRACE_S
from gateway.server.runner import ServerThread
from gateway.settings import Settings
from gateway.testing.fake_gateway import FakeGateway, unit_settings
from gateway.testing.processes import prometheus_samples, sample_sum

KEY = "sk-slow-clients-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


def refused(gw: FakeGateway, reason: str) -> float:
    text = httpx.get(f"{gw.http_url}/metrics", timeout=5).text
    return sample_sum(
        prometheus_samples(text), "visiongate_connections_refused_total", reason=reason
    )


@contextlib.contextmanager
def sockets(gw: FakeGateway, n: int, first_bytes: bytes) -> Iterator[list[socket.socket]]:
    opened = []
    try:
        for _ in range(n):
            s = socket.create_connection((gw.server.host, gw.server.port), timeout=5)
            if first_bytes:
                s.sendall(first_bytes)
            opened.append(s)
        yield opened
    finally:
        for s in opened:
            s.close()


def read_until_closed(s: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """What the server sent until it closed the connection, and when (s since the call)."""
    t0 = time.monotonic()
    s.settimeout(0.2)
    data = b""
    while time.monotonic() - t0 < limit_s:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - t0


def test_300_half_request_lines_do_not_stop_a_normal_client(make_gateway) -> None:
    gw = make_gateway(settings=dict(api_keys=[KEY]))  # the default caps
    with sockets(gw, 300, b"GET /v1/mod") as flood:
        for _ in range(3):  # again and again while the flood holds
            t0 = time.monotonic()
            r = httpx.get(f"{gw.http_url}/v1/models", headers=AUTH, timeout=5)
            assert r.status_code == 200
            assert time.monotonic() - t0 < 1.0
        time.sleep(HEAD_GRACE_S + 0.1)  # past their grace, newcomers take their places
        with sockets(gw, 100, b"GET /v1/mod"):
            for _ in range(3):
                t0 = time.monotonic()
                r = httpx.get(f"{gw.http_url}/v1/models", headers=AUTH, timeout=5)
                assert r.status_code == 200
                assert time.monotonic() - t0 < 1.0
            # the oldest of the flood made room for the rest: closed with 408
            data, _ = read_until_closed(flood[0], 2)
            assert data.startswith(b"HTTP/1.1 408 ")
    # each newcomer closed as many of the old as it took to be back under the cap
    assert refused(gw, "max_unauthenticated_connections") >= 300 + 100 - 256


def test_a_new_connection_has_its_grace_to_send_a_head(make_gateway) -> None:
    """A flood reconnecting as fast as it can does not close a connection younger than
    HEAD_GRACE_S: a client that takes a moment between connecting and sending is served."""
    gw = make_gateway(settings=dict(api_keys=[KEY], max_unauthenticated_connections=8))
    with sockets(gw, 8, b"GET /v1/mod"):
        time.sleep(HEAD_GRACE_S + 0.1)
        # then 40 more, each over the cap
        with sockets(gw, 1, b"") as (slow_starter,), sockets(gw, 40, b"GET /v1/mod"):
            time.sleep(0.5)
            slow_starter.sendall(
                f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}"
                "\r\nConnection: close\r\n\r\n".encode()
            )
            data, _ = read_until_closed(slow_starter, 3)
            assert data.startswith(b"HTTP/1.1 200 "), data[:100]
    assert refused(gw, "max_unauthenticated_connections") >= 8


def test_a_head_that_never_ends_is_cut_off(make_gateway) -> None:
    gw = make_gateway(settings=dict(header_timeout_s=0.5))
    with sockets(gw, 2, b"") as (partial, silent):
        partial.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # no blank line, ever
        data, took = read_until_closed(partial, 5)
        assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n") and took < 2
        data, took = read_until_closed(silent, 5)  # nothing sent: closed without an answer
        assert data == b"" and took < 2
    assert refused(gw, "header_timeout") == 2


def test_a_body_trickled_at_1_byte_a_second_is_cut_off_with_408(make_gateway) -> None:
    gw = make_gateway(settings=dict(api_keys=[KEY], body_timeout_s=1.0))
    with sockets(gw, 1, b"") as (s,):
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {KEY}\r\n".encode()
            + b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n"
        )
        t0 = time.monotonic()
        data = b""
        s.settimeout(0.05)
        while time.monotonic() - t0 < 8 and not data:
            with contextlib.suppress(OSError):
                s.sendall(b" ")
            with contextlib.suppress(TimeoutError):
                data = s.recv(65536)
            time.sleep(0.95)
        took = time.monotonic() - t0
    assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), data
    assert data.endswith(b'"code":"request_timeout"}}')  # the OpenAI-shaped error body
    assert 1.0 <= took < 4.0
    assert refused(gw, "body_timeout") == 1
    # a body sent at once is unaffected
    r = httpx.post(
        f"{gw.http_url}/v1/chat/completions",
        headers=AUTH,
        json={"model": "fake-echo", "messages": [{"role": "user", "content": "hi"}]},
        timeout=5,
    )
    assert r.status_code == 200


def errors(gw: FakeGateway, code: str) -> float:
    text = httpx.get(f"{gw.http_url}/metrics", timeout=5).text
    return sample_sum(prometheus_samples(text), "visiongate_errors_total", code=code)


def test_a_body_that_never_arrives_is_not_an_internal_error(make_gateway) -> None:
    """The app's read of a body the guard cut off (or the client gave up on) ends in a
    disconnect: counted as the client's (`invalid_request`, as a client gone before its
    answer), never as the gateway's own `internal_error`."""
    gw = make_gateway(settings=dict(api_keys=[KEY], body_timeout_s=0.5))
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        + f"Authorization: Bearer {KEY}\r\n".encode()
        + b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n"
    )
    with sockets(gw, 2, head) as (cut, quitter):
        cut.sendall(b'{"model": ')  # then nothing: cut off with 408
        quitter.sendall(b'{"model": ')
        time.sleep(0.2)
        quitter.close()  # the client gives up before its body is in
        data, _ = read_until_closed(cut, 5)
    assert data.startswith(b"HTTP/1.1 408 "), data[:100]
    assert refused(gw, "body_timeout") == 1
    deadline = time.monotonic() + 3  # the app's side of a request ends after its socket's
    while (
        errors(gw, "invalid_request") + errors(gw, "internal_error") < 2
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert errors(gw, "internal_error") == 0
    assert errors(gw, "invalid_request") == 2


def test_a_large_body_at_a_fair_rate_is_not_cut_off(make_gateway) -> None:
    gw = make_gateway(settings=dict(api_keys=[KEY], body_timeout_s=0.5, body_min_rate=20_000))
    body = (
        b'{"model": "fake-echo", "messages": [{"role": "user", "content": "'
        + b"a" * 60_000
        + b'"}]}'
    )
    with sockets(gw, 1, b"") as (s,):
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {KEY}\r\n".encode()
            + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        )
        for i in range(0, len(body), 10_000):  # 40,000 bytes a second, for 1.5 s
            s.sendall(body[i : i + 10_000])
            time.sleep(0.25)
        data, _ = read_until_closed(s, 3)
    assert data.startswith(b"HTTP/1.1 200 "), data[:200]
    assert refused(gw, "body_timeout") == 0


def test_past_max_connections_new_ones_get_503(make_gateway) -> None:
    gw = make_gateway(
        settings=dict(api_keys=[KEY], max_connections=20, max_unauthenticated_connections=20)
    )
    head = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()
    with sockets(gw, 20, head) as held:  # 20 keep-alive connections, each with a request in
        for s in held:
            data = s.recv(65536)
            assert data.startswith(b"HTTP/1.1 200 ")
        # none of them is reading a head now (they wait for their next request, a head in
        # the making): the oldest gives way to a new one
        with sockets(gw, 1, b"") as (new,):
            new.sendall(head)
            data, _ = read_until_closed(new, 0.5)
            assert data.startswith(b"HTTP/1.1 200 "), data[:100]
    assert refused(gw, "max_connections") >= 1


def test_connections_busy_with_requests_are_never_evicted(make_gateway) -> None:
    from gateway.testing.fakes import FakeEngine

    gw = make_gateway(
        engine=FakeEngine(delay_s=0.3),
        settings=dict(max_connections=4, max_unauthenticated_connections=4),
    )
    body = b'{"model": "fake-echo", "messages": [{"role": "user", "content": "hello there"}]}'
    req = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    with sockets(gw, 4, req) as busy:
        time.sleep(0.1)  # all four answer slowly now
        with sockets(gw, 1, b"") as (late,):
            data, _ = read_until_closed(late, 2)
            assert data.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
            assert b"retry-after: 1" in data.lower() and data.endswith(b'"code":"busy"}}')
        for s in busy:  # each of the four still gets its answer
            s.settimeout(5)
            assert s.recv(65536).startswith(b"HTTP/1.1 200 ")


class SlowAcceptor:
    """A Litestar app whose WebSocket route waits before it accepts (a key store that hangs)."""

    def __init__(self, wait_s: float) -> None:
        @websocket("/ws")
        async def slow(socket: WebSocket) -> None:
            await asyncio.sleep(wait_s)
            await socket.accept()
            await socket.send_text("hello")
            await socket.close()

        self.app = Litestar(route_handlers=[slow])


@pytest.fixture
def slow_ws_server() -> Iterator[ServerThread]:
    settings = Settings.load({"ws_handshake_timeout_s": 0.5}, environ={})
    server = ServerThread(SlowAcceptor(3.0).app, settings).start()
    yield server
    server.stop()


def test_a_websocket_handshake_not_answered_in_time_gets_503(slow_ws_server) -> None:
    import websockets.sync.client as ws_client
    from websockets.exceptions import InvalidStatus

    t0 = time.monotonic()
    with pytest.raises(InvalidStatus) as refusal:
        ws_client.connect(f"ws://127.0.0.1:{slow_ws_server.port}/ws", open_timeout=5)
    assert refusal.value.response.status_code == 503
    assert time.monotonic() - t0 < 2.0


class LateSpeaker:
    """A Litestar app whose WebSocket route accepts at once, then speaks only later."""

    def __init__(self, wait_s: float) -> None:
        @websocket("/ws")
        async def late(socket: WebSocket) -> None:
            await socket.accept()
            await asyncio.sleep(wait_s)
            await socket.send_text("hello")
            await socket.close()

        self.app = Litestar(route_handlers=[late])


def test_an_accepted_websocket_outlives_the_handshake_deadline() -> None:
    """The guard hears of the accept (the protocol's keep-alive start), so a connection that
    says nothing for longer than the handshake deadline after it is not cut."""
    import websockets.sync.client as ws_client

    settings = Settings.load({"ws_handshake_timeout_s": 0.5}, environ={})
    server = ServerThread(LateSpeaker(1.5).app, settings).start()
    try:
        with ws_client.connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=5) as ws:
            assert ws.recv(timeout=5) == "hello"
    finally:
        server.stop()


def test_the_guard_settings_are_validated() -> None:
    from gateway.settings import SettingsError

    for bad in (
        {"header_timeout_s": 0},
        {"body_timeout_s": -1},
        {"ws_handshake_timeout_s": 4000},
        {"body_min_rate": -1},
        {"max_connections": 0},
        {"max_unauthenticated_connections": 0},
    ):
        with pytest.raises(SettingsError):
            Settings.load(bad, environ={})
    unit_settings(max_connections=10, max_unauthenticated_connections=10)


def test_a_flood_from_many_threads_leaves_the_books_balanced(make_gateway) -> None:
    """Connections opened and dropped at once from many threads: once they are gone, the
    guard counts none open (nothing leaks a place)."""
    gw = make_gateway(settings=dict(api_keys=[KEY], max_unauthenticated_connections=16))

    def churn() -> None:
        for _ in range(20):
            with (
                contextlib.suppress(OSError),
                socket.create_connection((gw.server.host, gw.server.port), timeout=2) as s,
            ):
                s.sendall(b"GET / HTTP/1.1\r\n")

    threads = [threading.Thread(target=churn) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    guard = gw.server.server.config.http_protocol_class.guard  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5
    while guard.open_connections > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert guard.open_connections == 0 and guard.unauthenticated == 0
    assert httpx.get(f"{gw.http_url}/v1/models", headers=AUTH, timeout=5).status_code == 200


def test_slow_bodies_behind_made_up_keys_do_not_fill_the_connections(make_gateway) -> None:
    """A key is not checked by the guard, so a flood that sends any `Authorization` and then
    trickles its bodies counts as identified: past `max_connections` the slowest of those
    bodies gives way to the new connection."""
    gw = make_gateway(settings=dict(api_keys=[KEY], max_connections=12))
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer made-up\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
    )
    with sockets(gw, 12, head):
        time.sleep(0.2)
        for _ in range(3):
            t0 = time.monotonic()
            r = httpx.get(f"{gw.http_url}/v1/models", headers=AUTH, timeout=5)
            assert r.status_code == 200 and time.monotonic() - t0 < 1.0
    assert refused(gw, "max_connections") == 1  # one gave way; the room stayed
