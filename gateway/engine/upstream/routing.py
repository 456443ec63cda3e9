"""Which upstream replica serves a request: session affinity with bounded load, and health.

Every replica serves the same model, so any of them can answer; what differs is what each has
cached. A replica's prefix cache (and its multimodal cache) holds the conversations it served,
so the next turn of a conversation is fastest where the last one ran. The route key names the
conversation: the session (`GenerationRequest.kv_key`) when there is one, else the cache
namespace and a hash of the conversation's opening (system text, first user message's text and
image digests), which a stateless client re-sending its history sends again unchanged.

Replicas are ordered for a key by rendezvous (highest-random-weight) hashing: each scores
`hash(key, replica)` and the highest wins. Adding or losing a replica moves only the keys that
scored it highest. Two rules bend the order:

- bounded load: a replica already holding `in_flight >= max(min_load, ceil(load_factor *
  (total + 1) / healthy))` requests (total: in flight over the healthy replicas) goes after
  those under the bound, so one hot conversation, or a hash that happens to favour one
  replica, cannot pile everything on it; when every replica is over, score order stands. The
  floor `min_load` keeps a light load where its prefix cache is: a replica batches many
  requests at once, and moving a conversation costs it a recompute of its whole prefix;
- health: replicas marked down are left out; when none is up, all are tried in score order
  (one attempt each), since "down" may be stale.

This module only orders and counts; the engine marks replicas up and down (`Replica.healthy`)
from its requests and its health loop, and holds `in_flight` around each attempt. Everything
runs on the engine's event loop, so plain integers suffice.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.engine.interface import GenerationRequest
    from gateway.engine.upstream.endpoints import Upstream

__all__ = ("Replica", "Router", "route_key")

# a plain-text prompt is routed by its start: a client extending a prompt keeps its replica
_PROMPT_PREFIX_CHARS = 1024


class Replica:
    """One upstream replica and what the engine learned about it."""

    __slots__ = (
        "context_tokens",
        "encoder_fingerprint",
        "healthy",
        "in_flight",
        "model",
        "name",
        "salt",
        "served",
        "upstream",
        "verified",
    )

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.name = upstream.name or upstream.base_url  # host:port: metrics, spans, logs
        self.model: str | None = upstream.model  # the model name sent to it
        self.healthy = False
        self.in_flight = 0
        self.context_tokens = 0  # its max_model_len, when it reports one
        self.served: tuple[str, ...] = ()  # model id and root it reports (embeds-mode check)
        self.encoder_fingerprint: str | None = None  # when it reports one (another visiongate)
        self.verified = False  # /v1/models answered (and, in embeds mode, the checkpoint matched)
        # the replica's part of every rendezvous hash: its base URL, so renaming a metric label
        # never moves keys
        self.salt = upstream.base_url.encode()

    def __repr__(self) -> str:
        state = "up" if self.healthy else "down"
        return f"Replica({self.name}, {state}, in_flight={self.in_flight})"


def _score(key: bytes, replica: Replica) -> int:
    h = hashlib.blake2b(replica.salt, digest_size=8)
    h.update(b"\0")
    h.update(key)
    return int.from_bytes(h.digest(), "big")


class Router:
    """Orders replicas for a route key (see the module docstring)."""

    __slots__ = ("load_factor", "min_load", "replicas")

    def __init__(
        self, replicas: Sequence[Replica], *, load_factor: float = 1.25, min_load: int = 4
    ) -> None:
        if not replicas:
            raise ValueError("at least one replica is needed")
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        self.replicas = list(replicas)
        self.load_factor = load_factor
        self.min_load = max(1, min_load)

    def by_score(self, key: bytes) -> list[Replica]:
        """Every replica, highest rendezvous score for `key` first."""
        return sorted(self.replicas, key=lambda r: _score(key, r), reverse=True)

    def bound(self) -> int:
        """Requests a healthy replica may hold before others under it go first."""
        healthy = [r for r in self.replicas if r.healthy]
        if not healthy:
            return 0
        total = sum(r.in_flight for r in healthy)
        return max(self.min_load, math.ceil(self.load_factor * (total + 1) / len(healthy)))

    def order(self, key: bytes) -> list[Replica]:
        """The replicas to try for `key`, in turn: healthy ones under the load bound by score,
        then healthy ones over it by score; every replica by score when none is healthy."""
        ranked = self.by_score(key)
        healthy = [r for r in ranked if r.healthy]
        if not healthy:
            return ranked
        cap = self.bound()
        under = [r for r in healthy if r.in_flight < cap]
        over = [r for r in healthy if r.in_flight >= cap]
        return under + over

    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.replicas)


def route_key(request: GenerationRequest) -> bytes:
    """What a request is routed by: its session, else its cache namespace and the opening of
    its conversation (the system text and the first user message's text and image digests)."""
    if request.kv_key:
        return b"session\0" + request.kv_key.encode()
    h = hashlib.blake2b(digest_size=16)
    h.update(b"salt\0")
    h.update((request.cache_salt or "").encode())
    if request.raw_prompt is not None:
        h.update(b"\0prompt\0")
        h.update(str(request.raw_prompt[:_PROMPT_PREFIX_CHARS]).encode())
        return h.digest()
    for message in request.messages:
        if message.role == "assistant":
            continue
        h.update(b"\0" + message.role.encode() + b"\0")
        for part in message.content:
            if isinstance(part, str):
                h.update(b"t" + part.encode())
            else:
                h.update(b"i" + part.digest.encode())
        if message.role == "user":  # the first user message ends the opening
            break
    return h.digest()
