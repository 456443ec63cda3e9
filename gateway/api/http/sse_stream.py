"""A streamed HTTP answer whose body chunks go to the server's own `send`.

Litestar's `Stream` sends each chunk through every middleware that wraps `send`: its
OpenTelemetry middleware (span bookkeeping on every message), its exception handling, request
ids, rate-limit headers, the body guard. All of them act only on `http.response.start`, and
OpenTelemetry on the last body message as well (it ends the server span there). `DirectStream`
sends the start and that last, empty message through the stack as before, and every chunk in
between to the `send` the server gave (`gateway.api.http.server_send`, kept in the scope by
the outermost `ServerSend`), so a chunk of an SSE answer costs one call of the server's send
(Litestar's loop over the chunks is rewritten here to call it without a wrapper between),
or, where the server writes chunks itself (`gateway.server.chunked_body.CHUNKS`), no ASGI
message at all while the socket takes them. Without a kept `send` (an app built without
`ServerSend`) it is Litestar's `Stream`.

Litestar streams a body in a task of its own while another waits in `receive` for the client's
`http.disconnect`, in an anyio task group: a task, a cancel scope and its teardown a response.
Where the server offers a disconnect watch (`gateway.server.chunked_body.disconnect_watch`),
the body is streamed in the request's own task instead, and a client gone cancels that task:
the stream stops where it waits, its generators' `finally` clauses run, and the response ends
as Litestar's ends it (quietly: a client gone is no error).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse

from gateway.api.http.server_send import server_send
from gateway.server.chunked_body import chunk_writer, disconnect_watch

if TYPE_CHECKING:
    from collections.abc import Callable

    from litestar.types import Message, Receive, Scope, Send

__all__ = ("DirectStream",)


class _DirectStreamingResponse(ASGIStreamingResponse):
    """Litestar's streaming response with its chunks sent to the server's `send`."""

    __slots__ = ()  # the same layout: a plain one becomes this one in place

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        direct = server_send(scope)
        split = (
            None
            if direct is None
            else _Split(send, direct, chunk_writer(scope), disconnect_watch(scope))
        )
        await super().__call__(scope, receive, send if split is None else split)

    async def send_body(self, send: Send, receive: Receive) -> None:
        """The body, in this task where the server watches for the client leaving (the module
        docstring); Litestar's task group elsewhere."""
        watch = send.watch if isinstance(send, _Split) else None
        task = asyncio.current_task()
        if watch is None or task is None:
            await super().send_body(send, receive)
            return
        left = False

        def leave() -> None:
            nonlocal left
            left = True
            task.cancel()

        stop = watch(leave)
        try:
            await self._stream(send)
        except asyncio.CancelledError:
            # the client's leaving ends the response; any other cancel goes on
            if not left or task.uncancel() > 0:
                raise
        finally:
            stop()

    async def _stream(self, send: Send) -> None:
        """Litestar's loop, each chunk handed straight to the server's `send`."""
        if not isinstance(send, _Split):
            await super()._stream(send)
            return
        direct, write, encoding = send.direct, send.write, self.encoding
        async for chunk in self.iterator:
            body = chunk if isinstance(chunk, bytes) else chunk.encode(encoding)
            if write is not None and write(body):  # written now: the socket takes it
                continue
            await direct({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _Split:
    """`send` for a body's chunks (`more_body`) to `direct`, for the rest through `stack`;
    `write`, the server's chunk writer, and `watch`, its disconnect watch, if it offers them."""

    __slots__ = ("direct", "stack", "watch", "write")

    def __init__(
        self,
        stack: Send,
        direct: Send,
        write: Callable[[bytes], bool] | None,
        watch: Callable[[Callable[[], None]], Callable[[], None]] | None,
    ) -> None:
        self.stack, self.direct, self.write, self.watch = stack, direct, write, watch

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.body" and message.get("more_body", False):
            await self.direct(message)
        else:
            await self.stack(message)


class DirectStream(Stream):
    """Litestar's `Stream`, its chunks sent as the module docstring says."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> ASGIResponse:
        response = super().to_asgi_response(*args, **kwargs)
        if type(response) is ASGIStreamingResponse:
            response.__class__ = _DirectStreamingResponse
        return response
