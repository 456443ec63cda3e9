"""A fair gate: at most `limit` holders at once, waiters let in round-robin by owner.

The Redis encoder's job stream is one first-in-first-out queue shared by every worker, so the
order jobs enter it is the order they are encoded. A gateway replica puts its jobs through this
gate: no more than `limit` of its jobs are in the stream at a time, and when one finishes the
next to enter is taken from the owners waiting in turn (first in, first out within an owner),
so one key's burst of images does not sit in the stream ahead of another key's single image.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Hashable

__all__ = ("FairGate",)


class FairGate:
    __slots__ = ("_lanes", "held", "limit")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.held = 0
        # owner -> its waiters; the dict's order is the turn order (first: next to enter)
        self._lanes: OrderedDict[Hashable, deque[asyncio.Future[None]]] = OrderedDict()

    @property
    def waiting(self) -> int:
        return sum(len(lane) for lane in self._lanes.values())

    @contextlib.asynccontextmanager
    async def hold(self, owner: Hashable) -> AsyncIterator[None]:
        """Wait for a place (in turn among owners), hold it for the block, then pass it on."""
        await self._acquire(owner)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, owner: Hashable) -> None:
        if self.held < self.limit and not self._lanes:
            self.held += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        lane = self._lanes.get(owner)
        if lane is None:
            lane = self._lanes[owner] = deque()  # a new owner joins the turn at the back
        lane.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # given a place, then cancelled: it goes to the next
            else:
                lane.remove(waiter)
                if not lane and self._lanes.get(owner) is lane:
                    del self._lanes[owner]
            raise

    def _release(self) -> None:
        while self._lanes:
            owner, lane = next(iter(self._lanes.items()))
            waiter = lane.popleft()
            if lane:
                self._lanes.move_to_end(owner)
            else:
                del self._lanes[owner]
            if not waiter.done():
                waiter.set_result(None)  # the place passes on: `held` is unchanged
                return
        self.held -= 1
