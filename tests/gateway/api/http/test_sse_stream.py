"""`DirectStream`: a streamed answer's chunks go to the server's own `send`, its start and its
end through the middleware stack. A real Litestar app, called as the server calls it; the
server's `send` records what reaches it."""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Litestar, get

from gateway.api.http.server_send import ServerSend
from gateway.api.http.sse_stream import DirectStream

CHUNKS = [b"data: one\n\n", b"data: two\n\n", "data: three\n\n"]


@get("/stream")
async def stream() -> DirectStream:
    async def frames() -> Any:
        for chunk in CHUNKS:
            yield chunk

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

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/stream",
        "raw_path": b"/stream",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
    }
    await asyncio.wait_for(app(scope, receive, send), 5)
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
