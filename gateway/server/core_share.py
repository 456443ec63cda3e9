"""How the in-process engine and encoder share the CPU's cores.

Both run torch on threads of their own, and torch keeps the intra-op thread count per thread.
Splitting the cores once (the encoder a quarter, the engine the rest) leaves the encoder's share
idle between images, which on a small machine is half of its memory bandwidth: a decode step of
a small model is bound by it. `CoreShare` gives the engine every core while no image is being
encoded and the split while one is: the encoder marks each batch with `encoding()`, the engine
asks `engine_threads()` before each step. The engine's switch happens between steps, so a batch
that starts mid-step overlaps that one step only.

Used only when both halves run in this process with automatic thread counts; a fixed
`ENGINE_THREADS`, encoder workers elsewhere or an upstream engine need no sharing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ("CoreShare",)


class CoreShare:
    """The engine's intra-op threads now: `cores` while no image encodes, `cores -
    encoder_threads` (at least 1) while one does."""

    __slots__ = ("_encoding", "_lock", "cores", "encoder_threads")

    def __init__(self, cores: int, encoder_threads: int) -> None:
        if cores < 1 or encoder_threads < 1:
            raise ValueError("cores and encoder_threads must be >= 1")
        self.cores = cores
        self.encoder_threads = encoder_threads
        self._encoding = 0  # encoder batches running now
        self._lock = threading.Lock()

    def engine_threads(self) -> int:
        if self._encoding:  # a plain read: a step that sees a stale value is one step late
            return max(1, self.cores - self.encoder_threads)
        return self.cores

    @contextmanager
    def encoding(self) -> Iterator[None]:
        """Around one encoder batch: the engine gives up the encoder's cores meanwhile."""
        with self._lock:
            self._encoding += 1
        try:
            yield
        finally:
            with self._lock:
                self._encoding -= 1
