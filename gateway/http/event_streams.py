"""Replaying the events read ahead of a stream, and closing a stream whatever is cancelled.

The HTTP layers read a stream until its first text or its end before they choose the status
(an error before any output keeps its own), then hand on what was read followed by the rest.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import anyio

__all__ = ("close_shielded", "replay")

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
