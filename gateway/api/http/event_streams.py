"""Replaying the events read ahead of a stream, and closing a stream whatever is cancelled.

The HTTP layers read a stream until its first text or its end before they choose the status
(an error before any output keeps its own), then hand on what was read followed by the rest.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import anyio

from gateway.chat.events import Finished, ServiceEvent, TextChunk

__all__ = ("close_shielded", "read_ahead", "replay")

T = TypeVar("T")


async def replay(
    first: list[T], rest: AsyncIterator[T], ended: Callable[[T], bool]
) -> AsyncIterator[T]:
    """The events in `first`, then the rest of the stream unless `first` already ends it
    (`ended` of its last event) or is empty (the stream ended before any event)."""
    for event in first:
        yield event
    if first and not ended(first[-1]):
        async for event in rest:
            yield event


async def close_shielded(stream: AsyncIterator[Any]) -> None:
    """Close `stream` even inside a cancelled scope: on a client disconnect the handler's scope
    is already cancelled, and closing the stream is what returns its engine slots."""
    with anyio.CancelScope(shield=True):
        await stream.aclose()  # type: ignore[attr-defined]


async def read_ahead(
    events: AsyncIterator[ServiceEvent], cancel: threading.Event
) -> list[ServiceEvent]:
    """The service's events up to its first text or its end (whichever comes first), so that a
    failure before any output still gets its own HTTP status. Anything raised meanwhile (the
    client gone, the server stopping) cancels the answer and closes the stream."""
    first: list[ServiceEvent] = []
    try:
        while not first or not isinstance(first[-1], (TextChunk, Finished)):
            first.append(await events.__anext__())
    except StopAsyncIteration:
        pass
    except BaseException:
        cancel.set()
        await close_shielded(events)
        raise
    return first
