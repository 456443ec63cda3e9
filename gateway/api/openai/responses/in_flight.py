"""The responses this gateway process is answering now, so that one can be cancelled by id.

`ResponsesServing` adds each response once its request is admitted and takes it out when its
answer ends; `cancel` sets the response's cancel event (the engine stops within one decode step
and the response ends as cancelled, its partial answer kept as incomplete). Only the owner's
key may cancel a response, and only on the process that answers it: a response on another
replica is not found here.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

__all__ = ("InFlightResponses",)


@dataclass(slots=True)
class _Entry:
    owner: str
    cancel: threading.Event
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class InFlightResponses:
    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def add(self, response_id: str, owner: str, cancel: threading.Event) -> None:
        self._entries[response_id] = _Entry(owner, cancel)

    def end(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            entry.ended.set()

    def owned(self, response_id: str, owner: str) -> bool:
        entry = self._entries.get(response_id)
        return entry is not None and entry.owner == owner

    def signal(self, response_id: str, owner: str) -> bool:
        """Set the cancel event of `owner`'s response `response_id` if it is in flight here;
        False when this process answers no such response of theirs."""
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return False
        entry.cancel.set()
        return True

    async def cancel(self, response_id: str, owner: str, *, wait_s: float = 10.0) -> bool:
        """`signal`, then wait (up to `wait_s`) for the response to end."""
        entry = self._entries.get(response_id)
        if entry is None or not self.signal(response_id, owner):
            return False
        try:
            await asyncio.wait_for(entry.ended.wait(), wait_s)
        except TimeoutError:
            pass
        return True

    def __len__(self) -> int:
        return len(self._entries)
