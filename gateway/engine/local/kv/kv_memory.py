"""The local engine's KV memory, with one owner: the prefix cache, the byte budget it shares with
running sequences' buffers, and the spill store of sessions' KV.

The scheduler, its admission and its KV warm-ups talk to `KVMemory` alone; none of them sees a
cached block, a pin or the spill store. What they ask of it:

- `match(seq)`: how many leading positions of a sequence memory already holds (a look ahead of
  admission); `open(seq)`: the buffer of a sequence joining the batch, holding the longest prefix
  the prefix cache has of its positions, then what its session spilled, if that is longer;
- `commit(seq, pin, unpin=...)`: a sequence's computed positions into the prefix cache, pinned
  as `pin` says, then eviction back under the budget as `unpin` allows;
- `need`, `room_beside_pins`, `room_beside`, `held_by`: admission's arithmetic (a prompt's buffer
  for each of its choices; what a new sequence may take without unpinning any session; what is
  left beside the sequences that stay);
- `grow`, `reclaim`, `make_room`, `evict_for`: buffers growing and eviction, in the order below;
- `forget(kv_key)`: a session's pins, the blocks no other session pins, and its spilled entry.

Pins. What the cache holds is of three strengths: unpinned blocks (`pin="none"`: a preempted
sequence's, a choice other than the first, what a warm-up had computed when its session's request
took it over), a KV warm-up's pin for its session (`"warm"`: speculative work, the first pin to
go), and a session's latest turn (`"turn"`: its first choice's positions when it ends; it
replaces the session's warm pin and its previous turn's). A turn is also written to the spill
store when the engine has one (Redis: for other replicas, and for this one once its prefix cache
let the session go); `open` reads it back when the prefix cache holds less.

Budget. Every running sequence's buffer (requests' choices and warm-ups alike, at its allocated
size, not just the positions it has computed) and every cached block count against one byte
budget. When the total is over it, memory comes back cheapest loss first (`reclaim`):

1. unpinned blocks, least recently used first, then warm pins, oldest first;
2. running warm-ups' buffers (the scheduler drops them);
3. the newest sequence of a heavy key running two or more (preempted: its blocks go to the cache,
   unpinned);
4. sessions' turn pins, least recently used session first;
5. the newest sequence of the owner holding the most, while two or more sequences run (one
   sequence alone may exceed the budget rather than never run).

Steps 2, 3 and 5 are the scheduler's to carry out (they are about batch membership and fair
share); this object decides when each is needed. Between steps, whoever needs room says how much
may go: a request being admitted may take sessions' pins (`evict_for`), a warm-up never
(`make_room(unpin=False)`); after a request's commit the total is brought back under the budget,
pins too, after a warm-up's without them, and a preemption's commit evicts nothing (the step's
`reclaim` goes on in its order). Blocks, for the metrics, are `block_size` positions: a buffer
counts its capacity rounded up, the cache its bytes rounded up.

KV holding non-finite values (a forward that overflowed) is never committed, so no other request
is given it. Used from the scheduler's thread only, except `blocks`, which reads each buffer once
so that a sequence the loop drops meanwhile is counted or not, never half.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import structlog
import torch

from gateway.engine.local.batch import SeqKV
from gateway.engine.local.kv.blocks import KVEntry, block_hashes, position_keys
from gateway.engine.local.kv.prefix_cache import PrefixCache, PrefixMatch
from gateway.engine.local.sequence import GROW

if TYPE_CHECKING:
    from gateway.engine.local.kv.store import KVStore
    from gateway.engine.local.prompt import ImageSpan
    from gateway.engine.local.sequence import Sequence
    from gateway.engine.local.weights import LoadedModel

__all__ = ("KVLayout", "KVMemory", "Pin")

log = structlog.get_logger(__name__)

# how a committed sequence's blocks are held for its session (see the module doc)
Pin = Literal["none", "warm", "turn"]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of a model's KV: per position, `num_layers` x (keys, values) of `kv_heads` x
    `head_dim`, in `dtype` on `device`."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, weights: LoadedModel) -> KVLayout:
        text = weights.model.config.get_text_config()
        heads = int(text.num_attention_heads)
        return cls(
            int(text.num_hidden_layers),
            int(getattr(text, "num_key_value_heads", None) or heads),
            int(getattr(text, "head_dim", None) or text.hidden_size // heads),
            weights.dtype,
            weights.device,
        )

    @property
    def pos_bytes(self) -> int:
        """KV bytes of one position, all layers."""
        return SeqKV.bytes_per_position(self.num_layers, self.kv_heads, self.head_dim, self.dtype)

    def buffer(self, capacity: int) -> SeqKV:
        return SeqKV(
            self.num_layers, self.kv_heads, self.head_dim, capacity, self.dtype, self.device
        )


class KVMemory:
    """The prefix cache, the byte budget and the spill store behind one interface; see the
    module doc."""

    __slots__ = (
        "_cache",
        "_holders",
        "_spill_seed",
        "_store",
        "block_size",
        "budget_bytes",
        "layout",
    )

    def __init__(
        self,
        layout: KVLayout,
        budget_bytes: int,
        block_size: int,
        holders: Callable[[], Iterable[Iterable[Sequence]]],
        *,
        prefix_caching: bool = True,
        store: KVStore | None = None,
        spill_seed: bytes = b"",
    ) -> None:
        self.layout = layout
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        # the groups of sequences that hold buffers now (running requests, running warm-ups)
        self._holders = holders
        self._cache = PrefixCache(block_size, enabled=prefix_caching)
        self._store = store  # sessions' KV for other replicas (None: this process only)
        self._spill_seed = spill_seed  # the chain seed of what is spilled (the store checks it)

    @property
    def pos_bytes(self) -> int:
        return self.layout.pos_bytes

    # -- what is used, what is free ------------------------------------------------------------

    @staticmethod
    def held_by(seqs: Iterable[Sequence]) -> int:
        """KV bytes of these sequences' buffers."""
        return sum(s.kv.nbytes for s in seqs if s.kv is not None)

    def buffers(self) -> int:
        """KV bytes of every running sequence's buffer (warm-ups' included)."""
        return sum(self.held_by(group) for group in self._holders())

    @property
    def cached_bytes(self) -> int:
        """KV bytes of the blocks the prefix cache holds."""
        return self._cache.nbytes

    def used(self) -> int:
        """Buffers and cached blocks together."""
        return self.buffers() + self._cache.nbytes

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
        return self.budget_bytes - self.buffers() - self._cache.pinned_bytes()

    def room_beside_others_pins(self, owner: str | None) -> int:
        """What a new sequence of `owner` may take without unpinning another owner's sessions'
        blocks: the budget less the running buffers and the blocks other owners' sessions pin."""
        return self.budget_bytes - self.buffers() - self._cache.pinned_bytes_beside(owner)

    def room_beside(self, staying: Iterable[Sequence]) -> int:
        """The budget less the buffers of `staying` (the cache can give back all it holds)."""
        return self.budget_bytes - self.held_by(staying)

    # -- sessions' pins ------------------------------------------------------------------------

    @property
    def pinned_sessions(self) -> int:
        """Sessions whose latest turn is pinned."""
        return self._cache.pinned_sessions

    @property
    def warm_sessions(self) -> int:
        """Sessions a warm-up pinned blocks for."""
        return self._cache.warm_sessions

    @property
    def pinned_bytes(self) -> int:
        """KV bytes of the blocks sessions' turns pin (what only `unpin` evicts)."""
        return self._cache.pinned_bytes()

    def pinned(self, kv_key: str, pin: Pin = "turn") -> bool:
        """Whether the session holds a pin of this kind."""
        return pin != "none" and self._cache.holds_pin(kv_key, warm=pin == "warm")

    # -- joining the batch ---------------------------------------------------------------------

    def match(self, seq: Sequence) -> int:
        """How many leading positions of `seq` the prefix cache holds (all but its last at most:
        its logits give the next token); a look ahead of admission."""
        return self._match(seq)[1].length

    def open(self, seq: Sequence) -> tuple[SeqKV, int]:
        """A buffer for `seq` joining the batch, and how many of its positions it holds: the
        longest prefix the prefix cache has, then what its session spilled, if that is longer."""
        tokens, found = self._match(seq)
        limit = seq.known - 1
        kv = self.layout.buffer(seq.known + GROW)
        at = 0
        for block, n in found.blocks:
            kv.load(block.kv.unbind(0), at, n)
            at += n
        reused = found.length
        kv_key = seq.request.kv_key
        if kv_key is not None:
            self._cache.touch_session(kv_key)
            if self._store is not None and reused < limit:
                reused = max(reused, self._load_spilled(seq, kv, tokens, limit, kv_key))
        return kv, reused

    def _match(self, seq: Sequence) -> tuple[list[int], PrefixMatch]:
        assert seq.prompt is not None
        tokens = [*seq.prompt.tokens, *seq.generated]
        keys = position_keys(tokens, seq.prompt.images)
        hashes = block_hashes(tokens, seq.prompt.images, self.block_size, seq.seed)
        return tokens, self._cache.match(seq.seed, keys, hashes, seq.known - 1)

    def _load_spilled(
        self, seq: Sequence, kv: SeqKV, tokens: list[int], limit: int, kv_key: str
    ) -> int:
        """Load the session's spilled KV into `kv`, at most `limit` positions; returns the
        positions `kv` holds."""
        assert self._store is not None and seq.prompt is not None
        images = seq.prompt.images
        hashes = block_hashes(tokens, images, self.block_size, self._spill_seed)
        try:
            entry = self._store.get(kv_key, hashes)
        except Exception:  # a cache tier failing costs speed only
            log.exception("kv.spill_get_failed")
            return 0
        if entry is None:
            return 0
        n = min(entry.reusable(tokens, images, hashes), limit)
        if n <= kv.length:
            return kv.length
        kv.load([torch.stack((k[0], v[0])) for k, v in entry.layers], 0, n)
        kv.length = n
        return n

    # -- keeping what a sequence computed ------------------------------------------------------

    def commit(self, seq: Sequence, pin: Pin, *, unpin: bool | None) -> int:
        """Give `seq`'s computed positions to the prefix cache, held for its session as `pin`
        says (a turn is also spilled); then, unless `unpin` is None, evict what takes the total
        over the budget (`unpin`: sessions' pins too). Returns how many positions the prefix
        cache now holds for it (0: none, or KV not fit to share). `seq` keeps its buffer."""
        kv = seq.kv
        if kv is None or seq.prompt is None or seq.fed <= 0:
            return 0
        n = seq.fed
        layers = kv.layers
        # non-finite values anywhere reach the last layer's keys/values of their position
        if not bool(torch.isfinite(layers[-1][:, :, :n]).all()):
            log.warning("kv.not_finite", request_id=seq.request.request_id, positions=n)
            return 0
        tokens = [*seq.prompt.tokens, *seq.generated][:n]
        images = [sp for sp in seq.prompt.images if sp.start < n]
        kv_key = seq.request.kv_key
        kept = 0
        if self._cache.enabled:
            keys = position_keys(tokens, images)
            hashes = block_hashes(tokens, images, self.block_size, seq.seed)
            blocks = self._cache.insert(seq.seed, keys, hashes, layers, n)
            kept = n
            if kv_key is not None and pin != "none":
                self._cache.pin(kv_key, blocks, warm=pin == "warm", owner=seq.owner)
        if pin == "turn" and kv_key is not None and self._store is not None:
            entry = _spill_entry(tokens, images, layers, self.block_size, self._spill_seed)
            if entry is not None:
                self._store.put(kv_key, entry)
        if unpin is not None:
            self.make_room(unpin=unpin)
        return kept

    def forget(self, kv_key: str) -> None:
        """Drop a session's pins, the blocks no other session pins, and its spilled KV."""
        self._cache.forget(kv_key)
        if self._store is not None:
            self._store.delete(kv_key)

    def clear(self) -> None:
        """Drop every cached block, pins and all (the spill store keeps what it has)."""
        self._cache.clear()

    # -- growing, evicting ---------------------------------------------------------------------

    @staticmethod
    def grow(seq: Sequence, end: int) -> None:
        """Let `seq`'s buffer hold positions [0, end) (it grows by `GROW` past that); a step
        grows its sequences first and `reclaim`s after."""
        if seq.kv is not None and end > seq.kv.capacity:
            seq.kv.reserve(end + GROW)

    def make_room(self, need: int = 0, *, unpin: bool) -> bool:
        """Evict cached blocks until buffers, cache and `need` more bytes fit the budget
        (`unpin`: sessions' pins too); whether they fit now. Buffers are never touched here."""
        limit = self.budget_bytes - self.buffers() - need
        self._evict_to(limit, unpin=unpin)
        return self._cache.nbytes <= limit

    def evict_for(self, need: int, staying: Iterable[Sequence], seq: Sequence) -> None:
        """Evict cached blocks, sessions' pins too, until the buffers of `staying`, `need` more
        bytes and the cache fit the budget: room for `seq` being admitted. Pins go from `seq`'s
        owner's other sessions first (least recently used first), then from anyone's; its own
        session's pin (what it is about to reuse) goes last of all."""
        limit = self.room_beside(staying) - need
        if self._cache.nbytes > limit:
            self._cache.shrink(max(limit, 0), unpin=True, first=seq.owner, keep=seq.request.kv_key)

    def _evict_to(self, limit: int, *, unpin: bool) -> None:
        if self._cache.nbytes > limit:
            self._cache.shrink(max(limit, 0), unpin=unpin)

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
        cached = -(-self._cache.nbytes // block_bytes)
        return running + cached, max(cap, running + cached), cached


def _spill_entry(
    tokens: list[int],
    images: list[ImageSpan],
    layers: list[torch.Tensor],
    block_size: int,
    seed: bytes,
) -> KVEntry | None:
    """A session's computed positions as the spill store keeps them (copies, `[1, Hkv, n, D]`
    keys and values per layer); an image is kept whole or not at all. None: nothing to keep."""
    n = len(tokens)
    whole = [sp for sp in images if sp.start + sp.length <= n]
    if len(whole) != len(images):
        n = min(sp.start for sp in images if sp.start + sp.length > n)
        tokens = tokens[:n]
    if n <= 0:
        return None
    return KVEntry(
        tokens,
        whole,
        block_size,
        block_hashes(tokens, whole, block_size, seed),
        [(t[0, :, :n].unsqueeze(0).clone(), t[1, :, :n].unsqueeze(0).clone()) for t in layers],
    )
