"""Automatic prefix caching: KV blocks addressed by content, shared by every request that starts
with them, with or without a session.

A sequence's positions are cut into blocks of `block_size`. A full block is addressed by the
chained hash of its positions (`gateway.engine.local.kv.blocks.block_hashes`), the chain starting
from
a seed that names the model, weight dtype, block size and the request's namespace (the API key's
id): two keys never share KV, two sessions of one key do. A trailing partial block is kept too,
under its parent's hash with its positions listed, so a follow-up turn (the whole history sent
again, with or without a session) reuses every position that went through the model, not just
the full blocks. A lookup walks the chain of full blocks by hash, then takes the longest
position-by-position match among the children of the last matched block (a partial block, or a
full block whose later positions differ).

Blocks live outside any running sequence: when a sequence ends (or is preempted) its computed
positions are copied in once; when a sequence is admitted its matched prefix is copied into its
buffer once. Memory is accounted in bytes against the engine's KV budget, which running
sequences share; eviction is LRU over unpinned blocks, leaves before their parents (a chain is
stamped from its last block to its first), and a block's unreachable descendants go with it.
A session pins the blocks of its latest turn so they outlive other traffic; pins are dropped,
least recently used session first, when running sequences need the memory (a request being
admitted gives up its own owner's sessions' pins before anyone else's: `shrink(first=...)`).
A KV warm-up (the session's prompt prefilled ahead of its next turn) holds a weaker pin: warm
pins go before any session's pin, whenever unpinned blocks are not enough, and the session's
next turn replaces its warm pin with its own.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import torch

from gateway.engine.local.kv.blocks import PositionKey

__all__ = ("CachedBlock", "PrefixCache", "PrefixMatch")

_encode = msgspec.msgpack.Encoder().encode


class _Anyone:
    """`shrink`'s default `first`: no owner's pins go before another's (None is an owner)."""


_ANYONE = _Anyone()


@dataclass(slots=True, eq=False)
class CachedBlock:
    key: bytes  # the chained hash (full block) or a tail id (partial block)
    parent: bytes  # the previous block's hash, or the chain seed
    keys: tuple[PositionKey, ...]  # the positions it covers
    kv: torch.Tensor  # [layers, 2, Hkv, n, D]
    full: bool
    pins: int = 0
    warm: int = 0  # warm-up pins (`PrefixCache.pin(..., warm=True)`)
    stamp: int = 0

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass(slots=True)
class PrefixMatch:
    length: int = 0  # positions covered
    blocks: list[tuple[CachedBlock, int]] = field(default_factory=list)  # (block, positions used)


def _common(a: Sequence[PositionKey], b: Sequence[PositionKey]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Content-addressed KV blocks under a byte budget. Used from the scheduler thread only."""

    def __init__(self, block_size: int, *, enabled: bool = True) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self._blocks: dict[bytes, CachedBlock] = {}  # every block (full and partial) by key
        self._children: dict[bytes, dict[bytes, CachedBlock]] = {}
        self._pins: OrderedDict[str, list[bytes]] = OrderedDict()  # session -> pinned block keys
        self._warm: OrderedDict[str, list[bytes]] = OrderedDict()  # session -> warm-up pins
        self._owners: dict[str, str | None] = {}  # session -> the owner its turn's pin is for
        self._clock = 0
        self.nbytes = 0
        self._pinned_nbytes = 0  # of the blocks with pins > 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def pinned_sessions(self) -> int:
        return len(self._pins)

    @property
    def warm_sessions(self) -> int:
        return len(self._warm)

    def holds_pin(self, session: str, *, warm: bool = False) -> bool:
        """Whether `session` pins blocks (`warm`: a warm-up's pin, else its turn's)."""
        return session in (self._warm if warm else self._pins)

    def pinned_bytes(self) -> int:
        """Bytes of the blocks some session pins (what `shrink(unpin=False)` cannot free)."""
        return self._pinned_nbytes

    def pinned_bytes_beside(self, owner: str | None) -> int:
        """Bytes of the blocks some session of an owner other than `owner` pins."""
        seen: set[bytes] = set()
        total = 0
        for session, keys in self._pins.items():
            if self._owners.get(session) == owner:
                continue
            for key in keys:
                block = self._blocks.get(key)
                if block is not None and block.pins and key not in seen:
                    seen.add(key)
                    total += block.nbytes
        return total

    def num_blocks(self) -> tuple[int, int]:
        """(blocks, pinned blocks)."""
        return len(self._blocks), sum(1 for b in self._blocks.values() if b.pins)

    # -- lookup --------------------------------------------------------------------------------

    def match(
        self,
        seed: bytes,
        keys: Sequence[PositionKey],
        hashes: Sequence[bytes],
        limit: int,
    ) -> PrefixMatch:
        """The longest cached prefix of a sequence (at most `limit` positions); its blocks count
        as used now (the least recently used go first)."""
        found = PrefixMatch()
        if not self.enabled or limit <= 0:
            return found
        bs = self.block_size
        parent = seed
        for h in hashes:
            block = self._blocks.get(h)
            if block is None or found.length + bs > limit:
                break
            found.blocks.append((block, bs))
            found.length += bs
            parent = h
        # inside the next block: the longest position-by-position match among parent's children
        rest = keys[found.length : min(found.length + bs, limit)]
        best, best_n = None, 0
        for child in self._children.get(parent, {}).values():
            n = _common(child.keys, rest)
            if n > best_n:
                best, best_n = child, n
        if best is not None:
            found.blocks.append((best, best_n))
            found.length += best_n
        self._touch([b for b, _ in found.blocks])
        return found

    def _touch(self, chain: Sequence[CachedBlock]) -> None:
        # leaves get older stamps than their parents: eviction takes a chain from its end
        for block in reversed(chain):
            self._clock += 1
            block.stamp = self._clock

    # -- insertion -----------------------------------------------------------------------------

    def insert(
        self,
        seed: bytes,
        keys: Sequence[PositionKey],
        hashes: Sequence[bytes],
        layers: Sequence[torch.Tensor],  # per layer [2, Hkv, >= n, D]
        n: int,
    ) -> list[bytes]:
        """Keep positions [0, n) of a sequence; return the keys of the blocks that cover them."""
        if not self.enabled or n <= 0:
            return []
        bs = self.block_size
        chain: list[CachedBlock] = []
        parent = seed
        full = min(n // bs, len(hashes))
        for i in range(full):
            h = hashes[i]
            block = self._blocks.get(h)
            if block is None:
                block = self._add(
                    h, parent, tuple(keys[i * bs : (i + 1) * bs]), layers, i * bs, bs, True
                )
            chain.append(block)
            parent = h
        start = full * bs
        if start < n:
            tail = tuple(keys[start:n])
            siblings = self._children.get(parent, {})
            covering = next((c for c in siblings.values() if c.keys[: len(tail)] == tail), None)
            if covering is None:
                # a longer partial block supersedes the shorter ones it extends
                for c in list(siblings.values()):
                    if not c.full and not c.pins and not c.warm and tail[: len(c.keys)] == c.keys:
                        self._remove(c)
                tid = hashlib.blake2b(
                    b"tail" + parent + _encode(list(tail)), digest_size=16
                ).digest()
                covering = self._add(tid, parent, tail, layers, start, len(tail), False)
            chain.append(covering)
        self._touch(chain)
        return [b.key for b in chain]

    def _add(
        self,
        key: bytes,
        parent: bytes,
        keys: tuple[PositionKey, ...],
        layers: Sequence[torch.Tensor],
        start: int,
        n: int,
        full: bool,
    ) -> CachedBlock:
        kv = torch.stack([layer[:, :, start : start + n] for layer in layers])  # [L, 2, Hkv, n, D]
        block = CachedBlock(key, parent, keys, kv, full)
        self._blocks[key] = block
        self._children.setdefault(parent, {})[key] = block
        self.nbytes += block.nbytes
        return block

    def _remove(self, block: CachedBlock) -> None:
        if self._blocks.pop(block.key, None) is None:
            return
        self.nbytes -= block.nbytes
        if block.pins:
            self._pinned_nbytes -= block.nbytes
            block.pins = 0
        block.warm = 0
        siblings = self._children.get(block.parent)
        if siblings is not None:
            siblings.pop(block.key, None)
            if not siblings:
                del self._children[block.parent]
        # what hangs below it can no longer be reached
        for child in list(self._children.get(block.key, {}).values()):
            self._remove(child)

    # -- sessions ------------------------------------------------------------------------------

    def pin(
        self,
        session: str,
        keys: Sequence[bytes],
        *,
        warm: bool = False,
        owner: str | None = None,
    ) -> None:
        """Pin `keys` for `session` (of `owner`), replacing what it pinned before; `warm`: as its
        warm-up's (weaker) pin, beside its turn's pin. A turn's pin replaces the warm-up's too."""
        if warm:
            self.unwarm(session)
            warmed = [self._blocks[k] for k in keys if k in self._blocks]
            for b in warmed:
                b.warm += 1
            self._warm[session] = [b.key for b in warmed]
            return
        self.unwarm(session)
        self.unpin(session)
        blocks = [self._blocks[k] for k in keys if k in self._blocks]
        for b in blocks:
            if not b.pins:
                self._pinned_nbytes += b.nbytes
            b.pins += 1
        self._pins[session] = [b.key for b in blocks]
        self._owners[session] = owner

    def unpin(self, session: str) -> None:
        self._owners.pop(session, None)
        for key in self._pins.pop(session, []):
            block = self._blocks.get(key)
            if block is not None and block.pins:
                block.pins -= 1
                if not block.pins:
                    self._pinned_nbytes -= block.nbytes

    def unwarm(self, session: str) -> None:
        """Drop `session`'s warm-up pin."""
        for key in self._warm.pop(session, []):
            block = self._blocks.get(key)
            if block is not None and block.warm:
                block.warm -= 1

    def touch_session(self, session: str) -> None:
        if session in self._pins:
            self._pins.move_to_end(session)

    def forget(self, session: str) -> None:
        """Drop a session's pins and the blocks no other session pins."""
        keys = [*self._pins.get(session, []), *self._warm.get(session, [])]
        self.unpin(session)
        self.unwarm(session)
        for key in keys:
            block = self._blocks.get(key)
            if block is not None and not block.pins and not block.warm:
                self._remove(block)

    # -- memory --------------------------------------------------------------------------------

    def shrink(
        self,
        target_bytes: int,
        *,
        unpin: bool,
        first: str | _Anyone | None = _ANYONE,
        keep: str | None = None,
    ) -> int:
        """Evict until at most `target_bytes` are held: unpinned blocks, least recently used
        first, then warm-up pins (oldest first), then with `unpin` sessions' pins (least
        recently used first; the sessions of owner `first` before any other's, when given;
        session `keep`'s last of all). Returns bytes freed."""
        before = self.nbytes
        while self.nbytes > target_bytes:
            victims = sorted(
                (b for b in self._blocks.values() if not b.pins and not b.warm),
                key=lambda b: b.stamp,
            )
            if victims:
                for block in victims:
                    self._remove(block)
                    if self.nbytes <= target_bytes:
                        break
                continue
            if self._warm:
                self.unwarm(next(iter(self._warm)))
                continue
            if not unpin or not self._pins:
                break
            self.unpin(self._unpin_next(first, keep))
        return before - self.nbytes

    def _unpin_next(self, first: str | _Anyone | None, keep: str | None) -> str:
        """The session whose pin goes next (`shrink`): the least recently used of owner
        `first`'s, then of anyone's, `keep` only when it is the last one left."""
        others = [s for s in self._pins if s != keep]
        if not others:
            return next(iter(self._pins))
        if not isinstance(first, _Anyone):
            for session in others:
                if self._owners.get(session) == first:
                    return session
        return others[0]

    def clear(self) -> None:
        self._pinned_nbytes = 0
        self._blocks.clear()
        self._children.clear()
        self._pins.clear()
        self._owners.clear()
        self._warm.clear()
        self.nbytes = 0
