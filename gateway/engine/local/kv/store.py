"""Where per-session KV entries live between turns: the `KVStore` protocol and its memory store.

A store maps a `kv_key` (the session id) to one `KVEntry`. It does not decide reuse: the engine
compares the entry's block hashes with the new prompt's. `get(key, hashes)` may skip an entry
whose first block already differs (a Redis-backed store then avoids loading its tensors).
`MemoryKVStore` keeps entries in the process under a byte budget, LRU across keys: the protocol
without a server. The engine spills only to Redis (`gateway.engine.local.kv.redis_store`), since
its prefix cache already holds sessions' KV in memory.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import structlog

from gateway.engine.local.kv.blocks import KVEntry

__all__ = ("KVStore", "MemoryKVStore", "first_block_differs")

log = structlog.get_logger(__name__)


def first_block_differs(entry_hashes: Sequence[bytes], hashes: Sequence[bytes] | None) -> bool:
    return bool(hashes) and bool(entry_hashes) and entry_hashes[0] != hashes[0]


@runtime_checkable
class KVStore(Protocol):
    """Per-key KV entries under a memory budget. Thread-safe; called from the engine's thread."""

    def get(self, key: str, hashes: Sequence[bytes] | None = None) -> KVEntry | None:
        """The entry for `key`, or None (absent, or its first block differs from `hashes`)."""

    def put(self, key: str, entry: KVEntry) -> None:
        """Store `entry` as the latest KV of `key`, replacing the previous one."""

    def delete(self, key: str) -> None: ...

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until pending writes to shared storage are done (true when none are left)."""

    def close(self) -> None: ...


class MemoryKVStore:
    """In-process entries, LRU-evicted across keys once their bytes pass `budget_bytes`."""

    def __init__(
        self, budget_bytes: int, on_evict: Callable[[str, KVEntry], None] | None = None
    ) -> None:
        self.budget_bytes = budget_bytes
        self._on_evict = on_evict
        self._entries: OrderedDict[str, KVEntry] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._nbytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: str, hashes: Sequence[bytes] | None = None) -> KVEntry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
        if first_block_differs(entry.hashes, hashes):
            return None
        return entry

    def put(self, key: str, entry: KVEntry) -> None:
        size = entry.nbytes
        evicted: list[tuple[str, KVEntry]] = []
        with self._lock:
            self._drop(key)
            if size > self.budget_bytes:
                log.info("kv.too_large", key=key, nbytes=size, budget=self.budget_bytes)
                evicted.append((key, entry))
            else:
                self._entries[key] = entry
                self._sizes[key] = size
                self._nbytes += size
                while self._nbytes > self.budget_bytes:
                    old_key, old = self._entries.popitem(last=False)
                    self._nbytes -= self._sizes.pop(old_key)
                    evicted.append((old_key, old))
        for old_key, old in evicted:
            log.debug("kv.evicted", key=old_key, nbytes=old.nbytes)
            if self._on_evict is not None:
                self._on_evict(old_key, old)

    def delete(self, key: str) -> None:
        with self._lock:
            self._drop(key)

    def _drop(self, key: str) -> None:
        if key in self._entries:
            del self._entries[key]
            self._nbytes -= self._sizes.pop(key)

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._sizes.clear()
            self._nbytes = 0
