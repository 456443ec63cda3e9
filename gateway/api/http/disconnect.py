"""Stop computing an answer nobody will read.

A non-streamed answer is computed before anything is sent, so the server cannot notice on its
own that the client went away (a streamed one is cancelled by the server at its next frame).
Once a request's body has been read, the next message on its ASGI receive channel is
`http.disconnect`, sent when the client closes the connection: `unless_client_leaves` waits
for that beside the work and cancels the work when it comes, which releases its engine slots
through the serving code's own cleanup (each sets its cancel event and closes its streams).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog

from gateway.protocol.errors import GatewayError

__all__ = ("Receive", "unless_client_leaves")

log = structlog.get_logger("visiongate.http")

T = TypeVar("T")
Receive = Callable[[], Awaitable[Any]]  # the ASGI receive channel of a request


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


async def unless_client_leaves(receive: Receive, work: Awaitable[T], *, route: str) -> T:
    """`work`'s result; cancelled if the client disconnects first (the body must be read).
    The answer then goes nowhere: a GatewayError stands in for it."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself is cancelled (the server shuts down)
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        log.info("http_client_gone", route=route)
        raise GatewayError("invalid_request", "the client closed the connection")
    return task.result()
