"""`ChunkedCycle`: a chunked response's body chunks are framed by the gateway's protocol, not
by h11. Two real uvicorn servers on loopback serve the same ASGI app, one with uvicorn's own
h11 protocol and one with the gateway's; a raw socket reads what each writes, and the bytes
must be the same (the Date header aside) for every framing h11 may choose. Asked with `&direct`,
the app writes its chunks with the cycle's chunk writer where the server offers one (the
gateway's does, uvicorn's does not) and sends the rest."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.server.chunked_body import adopt, chunk_writer, disconnect_watch
from gateway.server.runner import GuardedH11Protocol
from tests.gateway.server.uvicorn_pair import serving, without_date

BIG = bytes(range(256)) * 4096  # 1 MiB
CHUNKS = [b"data: one\n\n", b"", b"\xff\x00" * 3000, "é".encode(), BIG, b"x"]
seen_cycles: list[str] = []
heard: dict[str, list[str]] = {}  # by query: what the app's disconnect watch heard (?watch)
written: dict[str, float] = {}  # by query: when the app's last chunk was taken
finished: dict[str, float] = {}  # and when its answer's end was
direct_writes: dict[str, int] = {}  # by query: chunks the writer took (asked with &direct)


async def watching_app(scope: dict[str, Any], query: str, send: Any) -> None:
    """`?watch=leave`: a first chunk, then wait for the disconnect watch to hear the client go.
    `?watch=stop`: the watch stopped before the client goes. `?watch=end`: a watch taken once
    the response is complete. `heard[query]` says what each heard."""
    import asyncio

    watch = disconnect_watch(scope)
    heard[query] = ["offered" if watch is not None else "none"]
    if watch is None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    left = asyncio.Event()

    def hear() -> None:
        heard[query].append("gone")
        left.set()

    await send({"type": "http.response.start", "status": 200, "headers": []})
    stop = watch(hear)
    if query == "watch=stop":
        stop()
    if query == "watch=end":
        stop()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        watch(hear)  # complete: nothing to hear
        return
    await send({"type": "http.response.body", "body": b"first\n", "more_body": True})
    try:
        await asyncio.wait_for(left.wait(), 3 if query == "watch=leave" else 1)
    except TimeoutError:
        heard[query].append("timeout")
    stop()  # stopping twice, or after the call, is nothing
    heard[query].append("done")


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if scope["query_string"].startswith(b"watch="):
        await receive()
        await watching_app(scope, scope["query_string"].decode(), send)
        return
    query, _, mode = scope["query_string"].decode().partition("&")
    seen_cycles.append(type(getattr(send, "__self__", None)).__name__)
    write = chunk_writer(scope) if mode == "direct" else None
    direct_writes[query] = 0
    await receive()
    headers = [(b"content-type", b"text/event-stream")]
    chunks = list(CHUNKS)
    if query == "length":
        headers.append((b"content-length", str(sum(map(len, chunks))).encode()))
    elif query.startswith("many="):  # enough to fill the socket's buffers
        chunks = [BIG] * int(query[5:])
    elif query == "leave":
        chunks = [b"first\n"]
    if write is not None:
        assert not write(b"early"), "a chunk written before the response started"

    async def chunk(body: bytes) -> None:
        if write is not None and write(body):
            direct_writes[query] += 1
            return
        await send({"type": "http.response.body", "body": body, "more_body": True})

    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for body in chunks:
        await chunk(body)
    written[query] = time.monotonic()
    if query == "leave":  # the client goes away; later chunks are dropped, as uvicorn does
        message = await receive()
        assert message["type"] == "http.disconnect"
        for _ in range(3):
            await chunk(b"late\n")
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    if write is not None:
        assert not write(b"late"), "a chunk written after the response ended"
    finished[query] = time.monotonic()


@pytest.fixture(scope="module")
def ports() -> Iterator[dict[str, int]]:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    with (
        serving(app, http=H11Protocol, access_log=False) as stock,
        serving(app, http=GuardedH11Protocol, access_log=False) as ours,
    ):
        yield {"stock": stock, "ours": ours}


def exchange(port: int, request: bytes, *, until_close: bool = False) -> bytes:
    """Send `request`; read until the connection closes, or until a chunked body's end."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while True:
            got = s.recv(1 << 20)
            if not got:
                return data
            data += got
            if not until_close and data.endswith(b"0\r\n\r\n"):
                return data


def dechunk(body: bytes) -> bytes:
    out = b""
    while True:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        out += rest[:n]
        assert rest[n : n + 2] == b"\r\n"
        body = rest[n + 2 :]


GET = b"GET /?%s HTTP/1.1\r\nHost: t\r\n\r\n"


@pytest.mark.parametrize("mode", [b"", b"&direct"], ids=["send", "writer"])
def test_chunked_bytes_are_h11s(ports: dict[str, int], mode: bytes) -> None:
    seen_cycles.clear()
    stock = exchange(ports["stock"], GET % (b"chunked" + mode))
    assert direct_writes["chunked"] == 0  # uvicorn's cycle offers no writer
    ours = exchange(ports["ours"], GET % (b"chunked" + mode))
    assert seen_cycles == ["RequestResponseCycle", "ChunkedCycle"]
    assert direct_writes["chunked"] == (len(CHUNKS) if mode else 0)
    assert b"transfer-encoding: chunked" in ours.lower()
    assert without_date(ours) == without_date(stock)
    body = ours.partition(b"\r\n\r\n")[2]
    assert dechunk(body) == b"".join(CHUNKS[:3]) + CHUNKS[3] + BIG + b"x"


@pytest.mark.parametrize("mode", [b"", b"&direct"], ids=["send", "writer"])
@pytest.mark.parametrize(
    "request_bytes",
    [
        b"HEAD /?chunked%s HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        b"GET /?chunked%s HTTP/1.0\r\n\r\n",  # no chunked framing in HTTP/1.0: h11 frames by close
        b"GET /?length%s HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
    ],
    ids=["head", "http10", "content-length"],
)
def test_other_framings_go_through_h11(
    ports: dict[str, int], request_bytes: bytes, mode: bytes
) -> None:
    direct_writes.clear()
    stock = exchange(ports["stock"], request_bytes % mode, until_close=True)
    ours = exchange(ports["ours"], request_bytes % mode, until_close=True)
    assert without_date(ours) == without_date(stock)
    assert not any(direct_writes.values()), "the writer took a chunk h11 frames otherwise"


def test_pipelined_requests_are_each_answered(ports: dict[str, int]) -> None:
    """A second request on the connection gets its cycle when the first answer ends (uvicorn's
    `on_response_complete`): both answers come whole, in order."""
    seen_cycles.clear()
    with socket.create_connection(("127.0.0.1", ports["ours"]), timeout=10) as s:
        s.sendall(GET % b"one" + GET % b"two")
        data = b""
        while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"0\r\n\r\n"):
            got = s.recv(1 << 20)
            assert got, "the server closed the connection"
            data += got
    first, second = data.split(b"HTTP/1.1 200")[1:]
    for answer in (first, second):
        assert dechunk(answer.partition(b"\r\n\r\n")[2]).endswith(BIG + b"x")
    assert seen_cycles == ["ChunkedCycle", "ChunkedCycle"]


@pytest.mark.parametrize("mode", ["", "&direct"], ids=["send", "writer"])
def test_a_client_that_does_not_read_holds_the_writer(ports: dict[str, int], mode: str) -> None:
    """Flow control as uvicorn's: with the socket's buffers full, a chunk's send waits until
    the client reads (the writer declines it and `send` waits); then every byte arrives, in
    order."""
    n = 48  # 48 MiB: more than loopback's socket buffers hold
    written.pop(f"many={n}", None)
    with socket.create_connection(("127.0.0.1", ports["ours"]), timeout=20) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        s.sendall(GET % f"many={n}{mode}".encode())
        time.sleep(1.0)
        assert f"many={n}" not in written, "the app wrote everything into a full socket"
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            got = s.recv(1 << 20)
            assert got
            data += got
    assert dechunk(data.partition(b"\r\n\r\n")[2]) == BIG * n
    if mode:  # some went at once, the rest through `send` once the client read
        assert 0 < direct_writes[f"many={n}"] < n


@pytest.mark.parametrize("mode", [b"", b"&direct"], ids=["send", "writer"])
def test_a_client_gone_drops_later_chunks(ports: dict[str, int], mode: bytes) -> None:
    """The app's sends after the client left return quietly (uvicorn's own behaviour), and the
    app hears `http.disconnect`; the writer takes none of them."""
    finished.pop("leave", None)
    with socket.create_connection(("127.0.0.1", ports["ours"]), timeout=10) as s:
        s.sendall(GET % (b"leave" + mode))
        data = b""
        while b"first\n" not in data:
            data += s.recv(65536)
    deadline = time.monotonic() + 10
    while "leave" not in finished:
        assert time.monotonic() < deadline, "the app's sends did not return after the client left"
        time.sleep(0.02)
    assert direct_writes["leave"] == (1 if mode else 0)  # the first chunk only


def _get_and_leave(port: int, query: bytes, *, leave: bool) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(GET % query)
        data = b""
        while b"first\n" not in data and not data.endswith(b"0\r\n\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        if not leave:
            s.settimeout(3)
            while not data.endswith(b"0\r\n\r\n") and (chunk := s.recv(65536)):
                data += chunk
    return data


def _wait_done(query: str) -> list[str]:
    deadline = time.monotonic() + 10
    while "done" not in heard.get(query, []):
        assert time.monotonic() < deadline, f"the app did not end: {heard.get(query)}"
        time.sleep(0.02)
    return heard[query]


def test_a_disconnect_watch_hears_the_client_leave(ports: dict[str, int]) -> None:
    """The gateway's cycle calls a watch once when the client goes mid-response; uvicorn's
    offers none."""
    heard.clear()
    _get_and_leave(ports["ours"], b"watch=leave", leave=True)
    assert _wait_done("watch=leave") == ["offered", "gone", "done"]
    _get_and_leave(ports["stock"], b"watch=leave", leave=True)
    assert heard["watch=leave"] == ["none"]


def test_a_stopped_or_late_watch_hears_nothing(ports: dict[str, int]) -> None:
    heard.clear()
    _get_and_leave(ports["ours"], b"watch=stop", leave=True)
    assert _wait_done("watch=stop") == ["offered", "timeout", "done"]
    raw = _get_and_leave(ports["ours"], b"watch=end", leave=False)
    assert raw.endswith(b"0\r\n\r\n")
    assert heard["watch=end"] == ["offered"]


def test_adopt_leaves_other_cycles_alone() -> None:
    adopt(None)

    class Other:
        pass

    other = Other()
    adopt(other)  # type: ignore[arg-type]
    assert type(other) is Other
