"""A byte-budgeted LRU of `bytes` values: the in-process tier shared by the caches.

It only does bookkeeping (recency, size, evictions); it is not thread-safe and is meant to be
used from one event loop, where each method runs without yielding.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

__all__ = ("ByteLRU",)


class ByteLRU:
    __slots__ = ("_entries", "evictions", "max_bytes", "nbytes")

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.evictions = 0
        self._entries: OrderedDict[Hashable, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable) -> bytes | None:
        """The value, marked most recently used; None if absent."""
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: Hashable, value: bytes) -> bool:
        """Store `value`, evicting least recently used entries to stay under the budget.

        A value larger than the whole budget is not stored (and evicts nothing); returns False.
        """
        if type(value) is not bytes:
            value = bytes(value)  # own an immutable copy of bytearray/memoryview input
        size = len(value)
        if size > self.max_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= len(old)
        self._entries[key] = value
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= len(evicted)
            self.evictions += 1
        return True

    def pop(self, key: Hashable) -> bytes | None:
        value = self._entries.pop(key, None)
        if value is not None:
            self.nbytes -= len(value)
        return value

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
