"""Text frames written straight to the transport (gateway/server/websocket_frames.py) are the
bytes the ASGI `send` writes. Two real uvicorn servers on loopback serve the same ASGI app, one
with uvicorn's own websockets-sansio protocol and one with the gateway's; the app writes its
text frames with the connection's writer where the server offers one (only the gateway's does)
and sends the rest; a raw socket reads what each server writes, with and without
permessage-deflate, and the bytes must be the same (the Date header aside)."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.frames import Frame, Opcode

from gateway.server.runner import RealtimeWSProtocol
from gateway.server.websocket_frames import text_frame, text_writer
from tests.gateway.server.uvicorn_pair import serving, without_date

# frames of every length encoding: 7-bit, 16-bit and 64-bit; repeated text, so that a deflated
# frame leans on the context the ones before it left
TEXTS = ["", "x", "é" * 62, "a" * 126, '{"delta":"' + "ab" * 30000 + '"}', "z" * 70000, "end"]
direct: dict[str, int] = {}  # by path: frames the writer took
declined_after_close: dict[str, bool] = {}
finished: dict[str, float] = {}
# a client's close frame (code 1000), masked as a client's frames must be
CLIENT_CLOSE = Frame(Opcode.CLOSE, (1000).to_bytes(2, "big")).serialize(mask=True, extensions=[])


@pytest.mark.parametrize("size", [0, 1, 125, 126, 65535, 65536, 70000])
def test_a_frame_is_the_one_websockets_serializes(size: int) -> None:
    payload = os.urandom(size)
    assert text_frame(payload) == Frame(Opcode.TEXT, payload).serialize(mask=False, extensions=[])


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "websocket":
        return
    path = scope["path"]
    write = text_writer(scope)
    direct[path] = 0
    assert (await receive())["type"] == "websocket.connect"
    if write is not None:
        assert not write(b"early"), "a frame written before the accept"
    await send({"type": "websocket.accept"})
    texts = ["m" * 1_000_000] * 48 if path == "/many" else TEXTS
    for text in texts:
        payload = text.encode()
        if write is not None and write(payload):
            direct[path] += 1
        else:
            await send({"type": "websocket.send", "text": text})
    finished[path] = time.monotonic()
    if path == "/closing":  # the client's close: the writer takes nothing after it
        assert (await receive())["type"] == "websocket.disconnect"
        declined_after_close[path] = write is None or not write(b"late")
        return
    await send({"type": "websocket.close", "code": 1000})


@pytest.fixture(scope="module")
def ports() -> Iterator[dict[str, int]]:
    with (
        serving(app, ws=WebSocketsSansIOProtocol) as stock,
        serving(app, ws=RealtimeWSProtocol) as ours,
    ):
        yield {"stock": stock, "ours": ours}


def handshake(path: str, deflate: bool) -> bytes:
    key = base64.b64encode(b"0123456789abcdef").decode()
    lines = [
        f"GET {path} HTTP/1.1",
        "Host: t",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
    ]
    if deflate:
        lines.append("Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def frames(data: bytes) -> Iterator[tuple[int, int]]:
    """(first byte, end offset) of each whole server frame in `data`."""
    at = 0
    while at + 2 <= len(data):
        size, head = data[at + 1] & 0x7F, 2
        if size == 126:
            size, head = int.from_bytes(data[at + 2 : at + 4], "big"), 4
        elif size == 127:
            size, head = int.from_bytes(data[at + 2 : at + 10], "big"), 10
        if at + head + size > len(data):
            return
        at += head + size
        yield data[at - head - size], at


def read_until_close(s: socket.socket) -> bytes:
    """Everything the server writes, up to and with its close frame (which is answered)."""
    data = b""
    while True:
        got = s.recv(1 << 20)
        assert got, "the server closed the connection without a close frame"
        data += got
        head, _, body = data.partition(b"\r\n\r\n")
        if any(first & 0x0F == Opcode.CLOSE.value for first, _ in frames(body)):
            s.sendall(CLIENT_CLOSE)
            return data


def exchange(port: int, path: str, deflate: bool) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(handshake(path, deflate))
        return without_date(read_until_close(s))


@pytest.mark.parametrize("deflate", [False, True], ids=["plain", "permessage-deflate"])
def test_written_frames_are_the_bytes_send_writes(ports: dict[str, int], deflate: bool) -> None:
    stock = exchange(ports["stock"], "/texts", deflate)
    assert direct["/texts"] == 0  # uvicorn's protocol offers no writer
    ours = exchange(ports["ours"], "/texts", deflate)
    assert direct["/texts"] == len(TEXTS)
    assert (b"permessage-deflate" in ours.partition(b"\r\n\r\n")[0]) is deflate
    assert ours == stock
    if deflate:  # compressed: far fewer bytes than the texts
        assert len(ours) < sum(len(t.encode()) for t in TEXTS) // 10


@pytest.mark.parametrize("deflate", [False, True], ids=["plain", "permessage-deflate"])
def test_a_real_client_reads_every_message(ports: dict[str, int], deflate: bool) -> None:
    """The `websockets` client (its own parser and inflater) reads what the writer wrote."""
    from websockets.sync.client import connect

    url = f"ws://127.0.0.1:{ports['ours']}/texts"
    with connect(url, compression="deflate" if deflate else None, max_size=None) as ws:
        got = [ws.recv() for _ in TEXTS]
    assert got == TEXTS
    assert direct["/texts"] == len(TEXTS)


def test_a_client_that_does_not_read_holds_the_sender(ports: dict[str, int]) -> None:
    """With the socket's buffers full the writer declines and the app's `send` waits until the
    client reads; then every byte arrives, in order."""
    finished.pop("/many", None)
    with socket.create_connection(("127.0.0.1", ports["ours"]), timeout=30) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        s.sendall(handshake("/many", deflate=False))
        time.sleep(1.0)
        assert "/many" not in finished, "the app wrote 48 MB into a full socket"
        data = read_until_close(s)
    body = data.partition(b"\r\n\r\n")[2]
    texts = [first for first, _ in frames(body) if first & 0x0F == Opcode.TEXT.value]
    assert len(texts) == 48
    assert 0 < direct["/many"] < 48  # some at once, the rest through `send` once it drained


def test_nothing_is_written_after_the_clients_close(ports: dict[str, int]) -> None:
    declined_after_close.pop("/closing", None)
    with socket.create_connection(("127.0.0.1", ports["ours"]), timeout=20) as s:
        s.sendall(handshake("/closing", deflate=False))
        data = b""
        while b"end" not in data:
            data += s.recv(1 << 20)
        s.sendall(CLIENT_CLOSE)
        deadline = time.monotonic() + 10
        while "/closing" not in declined_after_close:
            assert time.monotonic() < deadline, "the app did not hear the close"
            time.sleep(0.02)
    assert declined_after_close["/closing"]


def test_a_refused_upgrade_offers_no_writer() -> None:
    """No scope is handed to an app for an upgrade websockets refused (a bad version)."""

    async def run() -> None:
        with serving(app, ws=RealtimeWSProtocol) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(handshake("/texts", False).replace(b"Version: 13", b"Version: 7"))
            head = await asyncio.wait_for(reader.read(1 << 16), 10)
            writer.close()
            assert head.startswith((b"HTTP/1.1 426", b"HTTP/1.1 400")), head

    direct.pop("/texts", None)
    asyncio.run(run())
    assert "/texts" not in direct
