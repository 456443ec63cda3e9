"""The ownership index: which API keys sent which images.

Images are content-addressed (the sha256 digest of the bytes names them), but an API key may
use a digest only if it sent those bytes itself: a digest is a secret of the keys that sent it,
not a public name. The index records, per (owner, digest), one of two states:

    "sent"  the owner sent the bytes (inline, uploaded, or fetched for it)
    "used"  ... and has been given the image's visual tokens at least once, so a vision-cache
            hit is now that owner's own hit (see `gateway.chat.vision_resolver`)

It decides nothing and stores no images; the vision resolver asks it before it touches a cache.
`owner` is the owner id (`gateway.policy.auth`), never an API key.

`MemoryOwnerIndex` is an in-process LRU, bounded per owner and in total. `RedisOwnerIndex` puts
it in front of Redis keys `{namespace}:owner:{owner}:{digest}` (`encoder_worker.storage`) with a
TTL (the vision cache's) that every lookup restarts, so ownership lasts as long as the image is
in use and holds across replicas; Redis failures degrade to memory, logged, never raised.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from encoder_worker.storage import NAMESPACE, owner_key
from gateway.caching._redis_client import UNAVAILABLE

if TYPE_CHECKING:
    from gateway.caching._redis_client import RedisTier

__all__ = ("MemoryOwnerIndex", "OwnerIndex", "Ownership", "RedisOwnerIndex")

Ownership = Literal["sent", "used"]

_VALUES: dict[bytes, Ownership] = {b"sent": "sent", b"used": "used"}


@runtime_checkable
class OwnerIndex(Protocol):
    async def add(self, owner: str, digest: str) -> None:
        """`owner` sent the bytes of `digest` (an owner already "used" stays so)."""

    async def state(self, owner: str, digest: str) -> Ownership | None:
        """What `owner` holds of `digest` (None: nothing); restarts the entry's lifetime."""

    async def mark_used(self, owner: str, digest: str) -> None:
        """`owner` has been given the tokens of `digest`."""

    async def aclose(self) -> None: ...


class MemoryOwnerIndex:
    """In-process: per owner an LRU of digests (at most `max_per_owner`), and at most
    `max_entries` in all (past it, the least recently active owner's oldest entry goes)."""

    __slots__ = ("_owners", "_total", "evictions", "max_entries", "max_per_owner")

    def __init__(self, *, max_per_owner: int = 16384, max_entries: int = 262144) -> None:
        if max_per_owner < 1 or max_entries < 1:
            raise ValueError("max_per_owner and max_entries must be >= 1")
        self.max_per_owner = max_per_owner
        self.max_entries = max_entries
        self.evictions = 0
        self._total = 0
        # owner -> digest -> used; both levels in recency order, least recent first
        self._owners: OrderedDict[str, OrderedDict[str, bool]] = OrderedDict()

    def __len__(self) -> int:
        return self._total

    def peek(self, owner: str, digest: str) -> Ownership | None:
        """The state, marked most recently used; no I/O."""
        digests = self._owners.get(owner)
        if digests is None or digest not in digests:
            return None
        self._owners.move_to_end(owner)
        digests.move_to_end(digest)
        return "used" if digests[digest] else "sent"

    def put(self, owner: str, digest: str, used: bool) -> None:
        """Set the state (an entry marked used stays used); evicts past the bounds."""
        digests = self._owners.get(owner)
        if digests is None:
            digests = self._owners[owner] = OrderedDict()
        self._owners.move_to_end(owner)
        if digest in digests:
            digests[digest] = digests[digest] or used
            digests.move_to_end(digest)
            return
        digests[digest] = used
        self._total += 1
        if len(digests) > self.max_per_owner:
            digests.popitem(last=False)
            self._total -= 1
            self.evictions += 1
        while self._total > self.max_entries:
            oldest_owner, oldest = next(iter(self._owners.items()))
            oldest.popitem(last=False)
            self._total -= 1
            self.evictions += 1
            if not oldest:
                del self._owners[oldest_owner]

    async def add(self, owner: str, digest: str) -> None:
        self.put(owner, digest, False)

    async def state(self, owner: str, digest: str) -> Ownership | None:
        return self.peek(owner, digest)

    async def mark_used(self, owner: str, digest: str) -> None:
        self.put(owner, digest, True)

    async def aclose(self) -> None:
        self._owners.clear()
        self._total = 0


class RedisOwnerIndex:
    """`memory` in front of Redis (the image store's connection, `tier`): key
    `{namespace}:owner:{owner}:{digest}` holding b"sent" or b"used", TTL `ttl_s`.

    add: SET NX (keeps "used") then PEXPIRE. state: GETEX, which restarts the TTL; the answer
    is the stronger of Redis's and this replica's memory, and an entry this replica remembers
    but Redis lost (expired, flushed) is written back. mark_used: SET. With Redis unavailable,
    memory answers alone.
    """

    __slots__ = ("_redis", "_ttl_ms", "memory", "namespace")

    def __init__(
        self, memory: MemoryOwnerIndex, tier: RedisTier, ttl_s: float, namespace: str = NAMESPACE
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.memory = memory
        self.namespace = namespace
        self._redis = tier
        self._ttl_ms = max(1, int(ttl_s * 1000))

    def key(self, owner: str, digest: str) -> str:
        return owner_key(owner, digest, self.namespace)

    async def add(self, owner: str, digest: str) -> None:
        self.memory.put(owner, digest, False)
        key, ttl = self.key(owner, digest), self._ttl_ms

        async def write(r) -> None:
            async with r.pipeline(transaction=False) as pipe:
                pipe.set(key, b"sent", px=ttl, nx=True)
                pipe.pexpire(key, ttl)
                await pipe.execute()

        await self._redis.call("owner_add", write)

    async def state(self, owner: str, digest: str) -> Ownership | None:
        local = self.memory.peek(owner, digest)
        key, ttl = self.key(owner, digest), self._ttl_ms
        raw = await self._redis.call("owner_get", lambda r: r.getex(key, px=ttl))
        if raw is UNAVAILABLE:
            return local
        remote = _VALUES.get(raw) if raw is not None else None
        state: Ownership | None = "used" if "used" in (local, remote) else (remote or local)
        if state is None:
            return None
        if remote != state:  # Redis lost it or lags this replica: write back what is known
            value = state.encode()
            await self._redis.call("owner_put", lambda r: r.set(key, value, px=ttl))
        self.memory.put(owner, digest, state == "used")
        return state

    async def mark_used(self, owner: str, digest: str) -> None:
        self.memory.put(owner, digest, True)
        key, ttl = self.key(owner, digest), self._ttl_ms
        await self._redis.call("owner_used", lambda r: r.set(key, b"used", px=ttl))

    async def aclose(self) -> None:
        # the connection is the image store's; it closes it
        await self.memory.aclose()
