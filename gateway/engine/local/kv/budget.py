"""The scheduler's KV memory: one byte budget shared by running sequences' buffers and the prefix
cache's blocks, and the order in which memory is given back when they outgrow it.

What counts: every running sequence's buffer (requests' choices and KV warm-ups alike, at its
allocated size, not just the positions it has computed) plus every block the prefix cache holds.
What the cache holds is of three strengths: unpinned blocks, blocks a KV warm-up pinned for its
session (a warm pin, `PrefixCache.pin(..., warm=True)`), and blocks a session's latest turn
pinned. When the total is over the budget, memory comes back cheapest loss first (`reclaim`):

1. unpinned blocks, least recently used first, then warm pins, oldest first (the cache's
   `shrink(unpin=False)`: a warm-up's work is the cheapest to lose, it was speculative);
2. running warm-ups' buffers (the scheduler drops them);
3. the newest sequence of a heavy key running two or more (preempted: its blocks go to the cache,
   unpinned);
4. sessions' pins, least recently used session first;
5. the newest sequence of the owner holding the most, while two or more sequences run (one
   sequence alone may exceed the budget rather than never run).

Steps 2, 3 and 5 are the scheduler's to carry out (they are about batch membership and fair
share); this module decides when each is needed. Admission asks the same questions before a
sequence joins: `need` (a prompt's buffer for each of its choices), `room_beside_pins` (what it
may take without unpinning any session: what heavy keys and warm-ups are held to) and
`room_beside` (what a set of sequences leaves). Blocks, for the metrics, are `block_size`
positions: a buffer counts its capacity rounded up, the cache its bytes rounded up.

Used from the scheduler thread only, except `blocks`, which reads each buffer once so that a
sequence the loop drops meanwhile is counted or not, never half.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from gateway.engine.local.sequence import GROW

if TYPE_CHECKING:
    from gateway.engine.local.kv.prefix_cache import PrefixCache
    from gateway.engine.local.sequence import Sequence

__all__ = ("KVBudget",)


class KVBudget:
    """Byte accounting of the sequences' buffers and the prefix cache under one budget."""

    __slots__ = ("_holders", "block_size", "budget_bytes", "cache", "pos_bytes")

    def __init__(
        self,
        budget_bytes: int,
        pos_bytes: int,
        block_size: int,
        cache: PrefixCache,
        holders: Callable[[], Iterable[Iterable[Sequence]]],
    ) -> None:
        self.budget_bytes = budget_bytes
        self.pos_bytes = pos_bytes  # KV bytes of one position, all layers
        self.block_size = block_size
        self.cache = cache
        # the groups of sequences that hold buffers now (running requests, running warm-ups)
        self._holders = holders

    # -- what is used, what is free ------------------------------------------------------------

    @staticmethod
    def held_by(seqs: Iterable[Sequence]) -> int:
        """KV bytes of these sequences' buffers."""
        return sum(s.kv.nbytes for s in seqs if s.kv is not None)

    def buffers(self) -> int:
        """KV bytes of every running sequence's buffer (warm-ups' included)."""
        return sum(self.held_by(group) for group in self._holders())

    def used(self) -> int:
        """Buffers and cached blocks together."""
        return self.buffers() + self.cache.nbytes

    def free(self) -> int:
        """What is left of the budget (negative when over it)."""
        return self.budget_bytes - self.used()

    def need(self, seq: Sequence, *, choices: int | None = None) -> int:
        """KV bytes `seq` needs to join the batch: its positions and a step's growth, for each of
        its choices (`choices`: instead of its width; a warm-up holds one)."""
        width = seq.width if choices is None else choices
        return self.pos_bytes * (seq.known + GROW) * width

    def room_beside_pins(self) -> int:
        """What a new sequence may take without unpinning any session's blocks: the budget less
        the running buffers and the pinned blocks (unpinned and warm-pinned blocks can go)."""
        return self.budget_bytes - self.buffers() - self.cache.pinned_bytes()

    def room_beside(self, staying: Iterable[Sequence]) -> int:
        """The budget less the buffers of `staying` (the cache can give back all it holds)."""
        return self.budget_bytes - self.held_by(staying)

    # -- growing, evicting ---------------------------------------------------------------------

    @staticmethod
    def grow(seq: Sequence, end: int) -> None:
        """Let `seq`'s buffer hold positions [0, end) (it grows by `GROW` past that); a step
        grows its sequences first and `reclaim`s after."""
        if seq.kv is not None and end > seq.kv.capacity:
            seq.kv.reserve(end + GROW)

    def evict_to(self, limit: int, *, unpin: bool) -> None:
        """Evict cached blocks until the cache holds at most `limit` bytes (`unpin`: sessions'
        pins too, after unpinned blocks and warm pins)."""
        if self.cache.nbytes > limit:
            self.cache.shrink(max(limit, 0), unpin=unpin)

    def make_room(self, need: int = 0, *, unpin: bool) -> bool:
        """Evict cached blocks until buffers, cache and `need` more bytes fit the budget
        (`unpin`: sessions' pins too); whether they fit now. Buffers are never touched here."""
        limit = self.budget_bytes - self.buffers() - need
        self.evict_to(limit, unpin=unpin)
        return self.cache.nbytes <= limit

    def reclaim(
        self,
        drop_warmups: Callable[[], bool],
        preempt_heavy: Callable[[], bool],
        preempt_largest: Callable[[], bool],
    ) -> None:
        """Give memory back, in the module doc's order, until the total fits or nothing more may
        go. Each callback frees what its step names and says whether it freed anything:
        `drop_warmups` (every running warm-up), `preempt_heavy` (the newest sequence of a heavy
        key running two or more), `preempt_largest` (the newest of the owner holding the most;
        False while one sequence runs alone)."""
        while not self.make_room(unpin=False):
            if drop_warmups() or preempt_heavy():
                continue
            if self.make_room(unpin=True) or not preempt_largest():
                return

    # -- for the metrics -----------------------------------------------------------------------

    def blocks(self) -> tuple[int, int, int]:
        """(blocks used, blocks in all, blocks cached): used is the buffers' and the cache's;
        in all is the budget's, or what is used when that is more. Safe from any thread."""
        bs = self.block_size
        block_bytes = max(self.pos_bytes * bs, 1)
        cap = max(self.budget_bytes // block_bytes, 1)
        held = [s for group in self._holders() for s in list(group)]
        used_pos = sum(kv.capacity for s in held if (kv := s.kv) is not None)
        running = -(-used_pos // bs)
        cached = -(-self.cache.nbytes // block_bytes)
        return running + cached, max(cap, running + cached), cached
