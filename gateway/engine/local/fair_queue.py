"""Fair share of the engine between owners (API keys): who waits, who joins, who is preempted.

The scheduler serves many owners at once. First come, first served would let one owner with a
hundred long requests fill the batch, the prefill budget and the queue, so that another owner's
short question waits behind all of them. The policy here, pure Python and independent of the
model:

- `FairQueue`: waiting requests by owner. Admission takes owners in turn (round-robin over the
  owners with waiting requests), each owner's own requests in arrival order. A preempted request
  goes back to the front of its owner's line without changing that owner's turn.
- `share_budget_least_served` (what the scheduler uses) with `RecentService`: a step's prefill
  tokens go first to the owners served least lately (prefill tokens with a 10 s half-life),
  after a small floor for every owner, so a key's short prompt is prefilled at once beside keys
  that keep the engine busy with long ones. `share_budget` is the plain max-min split (an owner
  asking for less than an equal share gets all it asks; the rest is split again).
- `newest_of_largest`: whom to preempt. The newest sequence of the owner holding the most batch
  slots; by admission order, the oldest running sequence is never chosen while another runs, so
  every request keeps making progress and none is preempted forever.

Owners are opaque hashable ids (`None`: anonymous requests, which share one line). They are
never logged or exported: gauges only count owners.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Generic, TypeVar

__all__ = ("FairQueue", "newest_of_largest", "share_budget")

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Waiting items by owner: round-robin over owners, first in first out within one.

    Not thread-safe: the scheduler holds its lock around every call.
    """

    __slots__ = ("_lines", "_owner", "_size")

    def __init__(self, owner: Callable[[T], Hashable]) -> None:
        self._owner = owner
        # owner -> its waiting items; the dict's order is the turn order (first: next to serve)
        self._lines: dict[Hashable, deque[T]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[T]:
        for line in self._lines.values():
            yield from line

    @property
    def owners(self) -> int:
        """How many owners have requests waiting."""
        return len(self._lines)

    def depth(self, owner: Hashable) -> int:
        """How many requests of `owner` are waiting."""
        line = self._lines.get(owner)
        return len(line) if line is not None else 0

    def push(self, item: T) -> None:
        """Queue a new request at the back of its owner's line; a new owner's turn comes last."""
        self._lines.setdefault(self._owner(item), deque()).append(item)
        self._size += 1

    def push_front(self, item: T) -> None:
        """Put a request back at the front of its owner's line (a preempted one).

        An owner already waiting keeps its turn; one that was not waiting takes its turn after
        the owners that are, who have had nothing while it ran."""
        self._lines.setdefault(self._owner(item), deque()).appendleft(item)
        self._size += 1

    def peek(self) -> T | None:
        """The next request to admit: the first request of the owner whose turn it is."""
        for line in self._lines.values():
            return line[0]
        return None

    def heads(self) -> Iterator[T]:
        """The first request of every waiting owner, in turn order."""
        for line in self._lines.values():
            yield line[0]

    def take(self, item: T) -> None:
        """Remove `item` as served: if it heads its owner's line, that owner has had its turn
        and goes to the back of the turn order."""
        owner = self._owner(item)
        line = self._lines[owner]
        served = line[0] is item
        self._remove(owner, line, item)
        if served and line:
            del self._lines[owner]
            self._lines[owner] = line

    def discard(self, item: T) -> bool:
        """Remove `item` (cancelled, failed) without touching the turn order; False if absent."""
        owner = self._owner(item)
        line = self._lines.get(owner)
        if line is None or not any(x is item for x in line):
            return False
        self._remove(owner, line, item)
        return True

    def drain(self) -> list[T]:
        """Remove and return everything, owners in turn order."""
        items = list(self)
        self._lines.clear()
        self._size = 0
        return items

    def _remove(self, owner: Hashable, line: deque[T], item: T) -> None:
        if line[0] is item:
            line.popleft()
        else:
            for i, x in enumerate(line):
                if x is item:
                    del line[i]
                    break
            else:
                raise ValueError("not queued")
        self._size -= 1
        if not line:
            del self._lines[owner]


def share_budget(demands: list[int], budget: int, start: int = 0) -> list[int]:
    """Split `budget` tokens max-min fairly over `demands` (one per owner, in a fixed order).

    Water-filling: every owner with demand left gets an equal share, capped at its demand; what
    the capped ones leave is shared again. Tokens that do not divide evenly go one each to the
    owners from index `start` on (the caller rotates it from step to step, so the remainder
    favours no one). The result never exceeds a demand, and sums to min(budget, total demand).
    """
    grants = [0] * len(demands)
    left = max(budget, 0)
    active = [i for i, d in enumerate(demands) if d > 0]
    while left > 0 and active:
        share = left // len(active)
        if share == 0:  # fewer tokens than owners: one each, in rotated order
            n = len(demands)
            for i in sorted(active, key=lambda i: (i - start) % n)[:left]:
                grants[i] += 1
            break
        for i in active:
            g = min(share, demands[i] - grants[i])
            grants[i] += g
            left -= g
        active = [i for i in active if grants[i] < demands[i]]
    return grants


class RecentService:
    """What each owner was served lately: amounts that fade with a half-life, so an owner idle
    for `half_life_s` counts half as heavy. Entries below one unit are dropped."""

    __slots__ = ("_at", "_clock", "_served", "half_life_s")

    def __init__(self, half_life_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.half_life_s = half_life_s
        self._clock = clock
        self._at = clock()
        self._served: dict[Hashable, float] = {}

    def now(self) -> dict[Hashable, float]:
        """The faded amounts as of now (the live dict: read it, don't keep it)."""
        t = self._clock()
        decay = 0.5 ** ((t - self._at) / self.half_life_s)
        self._at = t
        for owner in list(self._served):
            self._served[owner] *= decay
            if self._served[owner] < 1.0:
                del self._served[owner]
        return self._served

    def add(self, owner: Hashable, amount: float) -> None:
        if amount > 0:
            self._served[owner] = self._served.get(owner, 0.0) + amount


def share_budget_least_served(
    demands: list[int], served: list[float], budget: int, floor_parts: int = 4
) -> list[int]:
    """Split `budget` tokens giving the owners served least lately the most.

    Every owner with demand first gets a floor of `budget // (floor_parts * owners)` tokens
    (capped at its demand), so none stalls; what is left goes to owners in order of `served`
    (their recent prefill tokens), least first, each up to its demand. A key that sends one
    short prompt is prefilled at once beside keys that keep the engine busy with long ones;
    as it is served its count grows and the order turns, so heavy keys still progress.
    Never exceeds a demand; sums to min(budget, total demand).
    """
    grants = [0] * len(demands)
    active = [i for i, d in enumerate(demands) if d > 0]
    if not active or budget <= 0:
        return grants
    floor = budget // (floor_parts * len(active))
    left = budget
    for i in active:
        grants[i] = min(floor, demands[i])
        left -= grants[i]
    for i in sorted(active, key=lambda i: (served[i], i)):
        if left <= 0:
            break
        g = min(demands[i] - grants[i], left)
        grants[i] += g
        left -= g
    return grants


def newest_of_largest(
    running: Iterable[T], owner: Callable[[T], Hashable], order: Callable[[T], int]
) -> T | None:
    """The sequence to preempt: the newest (highest `order`) of the owner holding the most
    sequences; between owners holding as many, the newest of all of theirs. None if empty."""
    items = list(running)
    if not items:
        return None
    counts = Counter(owner(s) for s in items)
    top = max(counts.values())
    return max((s for s in items if counts[owner(s)] == top), key=order)
