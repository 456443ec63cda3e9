"""Reading one upstream answer: the server-sent events of a streamed completion, parsed.

`read_events` sends the request and puts each `data:` line's chunk (decoded by msgspec straight
from bytes) on a queue, then `DONE` at `[DONE]`, `EOF` when the body ends without it, or the
exception that ended it (`UpstreamStatus` for a non-200 answer, with its body and Retry-After).
Lines end in \n, \r\n or \r; one line may hold at most `MAX_SSE_LINE_BYTES` (past that the
attempt fails: a replica cannot make the gateway buffer without bound). After `[DONE]` the body
is still read to its end so the connection goes back to the pool; `drain_reader` bounds that wait
(`DRAIN_S`), after which the connection is closed instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gateway.engine.upstream.wire import (
    DONE,
    EOF,
    Run,
    StreamBroken,
    UpstreamStatus,
    chunk_decoder,
    retry_after,
)

if TYPE_CHECKING:
    import httpx
    from opentelemetry.trace import Span

__all__ = ("DRAIN_S", "MAX_SSE_LINE_BYTES", "drain_reader", "read_events")

MAX_SSE_LINE_BYTES = 16 << 20  # one event line of the upstream's stream at most
DRAIN_S = 2.0  # reading a finished answer's body to its end, at most (then the connection goes)


async def read_events(
    client: httpx.AsyncClient,
    url: str,
    payload: bytes,
    headers: dict[str, str],
    queue: asyncio.Queue[Any],
    run: Run,
    span: Span,
) -> None:
    """Send the request and put its parsed chunks on `queue`, then `DONE` (or `EOF`, or
    the error). Runs as a task: cancelling it closes the response mid-stream, which makes the
    replica abort the request."""

    async def sent(name: str, _info: Mapping[str, Any]) -> None:
        if name.endswith("send_request_headers.started"):
            run.sent_at = time.perf_counter()

    try:
        request = client.build_request(
            "POST", url, content=payload, headers=headers, extensions={"trace": sent}
        )
        response = await client.send(request, stream=True)
        try:
            span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code != 200:
                body = await response.aread()
                raise UpstreamStatus(response.status_code, body, retry_after(response.headers))
            decode = chunk_decoder.decode
            done = False
            # server-sent events split into lines by hand, on bytes (msgspec decodes each
            # `data:` line's bytes directly). `partial` holds an unfinished line; only new
            # bytes are searched for its end, so a long line costs linear time.
            partial = bytearray()
            async for piece in response.aiter_bytes():
                if done:
                    continue  # after [DONE]: read to the end of the body all the same
                cut = max(piece.rfind(b"\n"), piece.rfind(b"\r"))  # \n, \r\n or \r
                if cut < 0:
                    partial += piece
                    if len(partial) > MAX_SSE_LINE_BYTES:
                        raise StreamBroken("an upstream event line is too long")
                    continue
                head, rest = piece[: cut + 1], piece[cut + 1 :]
                if partial:
                    partial += head
                    head = bytes(partial)
                    partial.clear()
                partial += rest
                for line in head.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, event names
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        queue.put_nowait(DONE)
                        break
                    queue.put_nowait(decode(data))
            last = bytes(partial).strip()
            if not done and last.startswith(b"data:"):  # a last line without its newline
                data = last[5:].strip()
                if data == b"[DONE]":
                    done = True
                    queue.put_nowait(DONE)
                elif data:
                    queue.put_nowait(decode(data))
            if not done:
                queue.put_nowait(EOF)
        finally:
            await response.aclose()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        queue.put_nowait(exc)


async def drain_reader(reader: asyncio.Task[None]) -> None:
    """Let `reader` finish a body whose answer is complete, for at most DRAIN_S."""
    with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
        await asyncio.wait_for(reader, DRAIN_S)
