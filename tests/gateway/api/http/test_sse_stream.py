"""`DirectStream`: a streamed answer's chunks go to the server's own `send`, its start and its
end through the middleware stack. A real Litestar app, called as the server calls it; the
server's `send` records what reaches it."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest
from litestar import Litestar, get

from gateway.api.http.server_send import ServerSend
from gateway.api.http.sse_stream import DirectStream
from gateway.server.chunked_body import CHUNKS as SERVER_CHUNKS
from gateway.server.runner import GuardedH11Protocol
from tests.gateway.server.uvicorn_pair import serving

CHUNKS = [b"data: one\n\n", b"data: two\n\n", "data: three\n\n"]


@get("/stream")
async def stream() -> DirectStream:
    async def frames() -> Any:
        for chunk in CHUNKS:
            yield chunk

    return DirectStream(frames(), media_type="text/event-stream")


endless: dict[str, Any] = {}  # what the endless stream saw: its tasks, how it ended


@get("/endless")
async def endless_stream() -> DirectStream:
    endless["handler_task"] = asyncio.current_task()

    async def frames() -> Any:
        endless["stream_task"] = asyncio.current_task()
        try:
            while True:
                yield b"data: tick\n\n"
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            endless["ended"] = "cancelled"
            raise
        finally:
            endless.setdefault("ended", "closed")

    return DirectStream(frames(), media_type="text/event-stream")


class Watching:
    """A middleware that wraps `send`, as the gateway's do: it records what passes it."""

    def __init__(self, app: Any) -> None:
        self.app, self.seen = app, []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def watching(message: Any) -> None:
            self.seen.append(message)
            await send(message)

        await self.app(scope, receive, watching)


def get_scope(path: str) -> dict[str, Any]:
    """The scope of `GET path` as a server would make it."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
    }


async def call(app: Any) -> list[dict[str, Any]]:
    """GET /stream as a server would; the messages that reach the server's `send`."""
    ended = asyncio.Event()
    sent: list[dict[str, Any]] = []
    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await ended.wait()  # the client leaves once the answer is over
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            ended.set()

    await asyncio.wait_for(app(get_scope("/stream"), receive, send), 5)
    return sent


def app_with(*, server_send: bool) -> tuple[Any, Watching]:
    app = Litestar([stream])
    watching = Watching(app.asgi_handler)
    app.asgi_handler = watching
    return (ServerSend(app) if server_send else app), watching


async def test_chunks_go_to_the_server_send_and_the_start_and_end_through_the_stack() -> None:
    app, watching = app_with(server_send=True)
    sent = await call(app)
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 4
    assert [m["body"] for m in sent[1:]] == [
        b"data: one\n\n",
        b"data: two\n\n",
        b"data: three\n\n",
        b"",
    ]
    assert [m.get("more_body") for m in sent[1:]] == [True, True, True, False]
    # the wrapper saw the start and the last, empty body (a span ends on it), no chunk
    assert [m["type"] for m in watching.seen] == ["http.response.start", "http.response.body"]
    assert watching.seen[1]["more_body"] is False and watching.seen[1]["body"] == b""
    assert watching.seen[0] is sent[0]


async def test_without_server_send_every_message_goes_through_the_stack() -> None:
    app, watching = app_with(server_send=False)
    sent = await call(app)
    assert [m["body"] for m in sent[1:]] == [
        b"data: one\n\n",
        b"data: two\n\n",
        b"data: three\n\n",
        b"",
    ]
    assert watching.seen == sent


def test_a_client_leaving_cancels_the_stream_in_the_requests_own_task() -> None:
    """On the gateway's server the body streams in the request's task (no second task waits
    for the disconnect), and a client gone cancels it there: the stream's generator ends where
    it waits, the server carries on."""
    endless.clear()
    app = ServerSend(Litestar([endless_stream, stream]))
    with serving(app, http=GuardedH11Protocol, access_log=False) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /endless HTTP/1.1\r\nHost: t\r\n\r\n")
            data = b""
            while data.count(b"tick") < 3:
                data += s.recv(65536)
        deadline = time.monotonic() + 5
        while "ended" not in endless:
            assert time.monotonic() < deadline, "the stream went on after the client left"
            time.sleep(0.01)
        assert endless["ended"] == "cancelled"
        assert endless["stream_task"] is endless["handler_task"]
        # and the server still answers
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
            data = b""
            while not data.endswith(b"0\r\n\r\n"):
                data += s.recv(65536)
        assert b"data: three" in data


async def test_a_cancel_from_elsewhere_is_not_taken_for_a_client_leaving() -> None:
    """The request's task cancelled by someone else (a server shutting down) while the body
    streams: the cancel goes on, it is not swallowed as a client's leaving would be."""
    endless.clear()
    app = ServerSend(Litestar([endless_stream]))
    watches: list[Any] = []

    def watch(callback: Any) -> Any:
        watches.append(callback)
        return lambda: watches.remove(callback)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        return None

    scope = get_scope("/endless")
    scope["extensions"] = {SERVER_CHUNKS: {"write": lambda body: True, "watch": watch}}
    task = asyncio.ensure_future(app(scope, receive, send))
    while not watches:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert endless["ended"] == "cancelled" and watches == []
