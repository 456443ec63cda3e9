"""Fair share of the engine between owners (API keys): who waits, who joins, who is preempted.

The scheduler serves many owners at once. First come, first served would let one owner with a
hundred long requests fill the batch, the prefill budget and the queue, so that another owner's
short question waits behind all of them. The policy here, pure Python and independent of the
model:

- `FairQueue`: waiting requests by owner. Admission takes owners in turn (round-robin over the
  owners with waiting requests), each owner's own requests in arrival order. A preempted request
  goes back to the front of its owner's line without changing that owner's turn.
- `share_budget`: a step's prefill tokens split max-min fairly between owners that are
  prefilling (an owner asking for less than an equal share gets all it asks; the rest is split
  again between the others), so a long prompt does not take every chunk while a short prompt of
  another owner waits.
- `newest_of_largest`: whom to preempt. The newest sequence of the owner holding the most batch
  slots; by admission order, the oldest running sequence is never chosen while another runs, so
  every request keeps making progress and none is preempted forever.

Owners are opaque hashable ids (`None`: anonymous requests, which share one line). They are
never logged or exported: gauges only count owners.
"""

from __future__ import annotations

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
