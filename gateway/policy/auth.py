"""API keys -> owner ids. With no keys configured every caller is the owner "anonymous".

Two kinds of keys. Static ones, listed in the `api_keys` setting, own `key_<16 hex of the key's
SHA-256>`. Managed ones (`gateway.policy.key_store`, made through the admin API once
`admin_api_key` is set) own their record's id; a revoked or expired one is refused
(`api_key_revoked`, `api_key_expired`, HTTP 401), and one whose record names allowed models that
do not include the gateway's is refused with `permission_denied` (403).

A key travels in a header only: `Authorization: Bearer <key>` (HTTP and WebSocket), or, for
browsers, which cannot set headers on a WebSocket, in the Realtime API's subprotocol form
`Sec-WebSocket-Protocol: realtime, openai-insecure-api-key.<key>`. The connection is then
accepted with a subprotocol that carries no key (`public_subprotocol`), so the key is never
echoed. A key in a URL (`?api_key=`) is refused: URLs end up in access logs, proxies and
browser history.

`owner()` is synchronous (transports call it where they have headers), while a managed key's
record lives in the store. So an ASGI middleware (`gateway.policy.key_guard.KeyResolver`) looks
the key up first, with `prefetch()`, and leaves the answer in a context variable that `owner()`
reads in the same request. Lookups go through an in-process cache of `cache_ttl_s` (1 s): at
most one store read per key per second per replica, and a revocation reaches every replica
within that second. While the store is unreachable a record read in the last `STALE_S` is
still used; past that the caller gets `busy` (503), never a pass.

Ephemeral keys (`ek_...`, `gateway.policy.client_secrets`) open the Realtime WebSocket only:
`owner()`, which every HTTP API calls, refuses one with `permission_denied` (403) before any
store read, and `prefetch()` skips them. The Realtime route calls `grant()` instead, which reads
the ephemeral record (`unauthorized` when unknown, `api_key_expired` past its expiry) and checks
its parent key again (`check_parent`: a revoked or expired managed parent refuses it, a static
parent must still be configured); `grant()` answers the owner id (the parent's) and the record,
whose session settings the connection applies.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from gateway.policy.client_secrets import is_ephemeral
from gateway.protocol.errors import GatewayError
from gateway.protocol.subprotocols import (
    KEY_SUBPROTOCOL_PREFIX,
    MSGPACK_SUBPROTOCOL,
    REALTIME_SUBPROTOCOL,
)

if TYPE_CHECKING:
    from gateway.policy.client_secrets import ClientSecret, ClientSecretStore, ParentKind
    from gateway.policy.key_store import KeyRecord, KeyStore

__all__ = (
    "KEY_SUBPROTOCOL_PREFIX",
    "QUERY_KEY_REFUSED",
    "REALTIME_SUBPROTOCOL",
    "STALE_S",
    "Authenticator",
    "Grant",
    "key_of",
    "public_subprotocol",
)

log = structlog.get_logger("visiongate.auth")

# the WebSocket close reason (1008) for `?api_key=`
QUERY_KEY_REFUSED = "pass the API key in the Authorization header or the subprotocol"
STALE_S = 60.0  # how long a cached record stands in for a store that does not answer
CACHE_ENTRIES = 10_000  # keys (and unknown digests) remembered; the oldest go first
SCRUBBED_KEYS = 4096  # managed secrets registered with the log scrubber per process

# (digest, record or None) that this request's middleware looked up
_prefetched: contextvars.ContextVar[tuple[str, KeyRecord | None] | None] = contextvars.ContextVar(
    "visiongate_prefetched_key", default=None
)


def public_subprotocol(offered: Iterable[str]) -> str | None:
    """The subprotocol to accept a WebSocket with: the msgpack one when offered, else
    `realtime` when offered, else none. Never one of the offered values that carries a key."""
    offered = list(offered)
    for name in (MSGPACK_SUBPROTOCOL, REALTIME_SUBPROTOCOL):
        if name in offered:
            return name
    return None


def _subprotocol_key(offered: Iterable[str]) -> str:
    for name in offered:
        if name.startswith(KEY_SUBPROTOCOL_PREFIX):
            return name[len(KEY_SUBPROTOCOL_PREFIX) :]
    return ""


def key_of(headers: Mapping[str, str], subprotocols: Iterable[str] = ()) -> str:
    """The key a caller sent: `Authorization: Bearer <key>`, else an offered
    `openai-insecure-api-key.<key>` subprotocol; "" when neither."""
    auth = headers.get("authorization", "")
    if auth:
        scheme, _, value = auth.partition(" ")
        return value.strip() if scheme.lower() == "bearer" else ""
    return _subprotocol_key(subprotocols)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


# what `key_store.new_secret` makes: the prefix and 43 URL-safe base64 characters
MANAGED_FORM = re.compile(r"vgk-[A-Za-z0-9_-]{43}")
EPHEMERAL_ONLY_REALTIME = "an ephemeral key (ek_...) opens a Realtime WebSocket only"


@dataclass(frozen=True, slots=True)
class Grant:
    """What a Realtime handshake's key grants: the owner id, and for an ephemeral key its
    record (the parent to check while open, the session settings to apply)."""

    owner: str
    ephemeral: ClientSecret | None = None


class Authenticator:
    __slots__ = (
        "_by_id",
        "_cache",
        "_clock",
        "_owners",
        "_records",
        "_scrubbed",
        "_served_model",
        "cache_ttl_s",
        "client_secrets",
        "store",
    )

    def __init__(
        self,
        api_keys: list[str],
        store: KeyStore | None = None,
        *,
        cache_ttl_s: float = 1.0,
        served_model: Callable[[], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        client_secrets: ClientSecretStore | None = None,
    ) -> None:
        # the owner id is a hash of the key: stable across restarts, never the key itself
        self._owners = {key: "key_" + _digest(key)[:16] for key in api_keys}
        self.store = store
        self.cache_ttl_s = cache_ttl_s
        self._served_model = served_model
        self._clock = clock
        # digest -> (read at, record or None for an unknown digest)
        self._cache: OrderedDict[str, tuple[float, KeyRecord | None]] = OrderedDict()
        self._records: OrderedDict[str, KeyRecord] = OrderedDict()  # key id -> last record read
        self._scrubbed: set[str] = set()
        # key id -> (read at, record or None): a managed parent of ephemeral keys
        self._by_id: OrderedDict[str, tuple[float, KeyRecord | None]] = OrderedDict()
        self.client_secrets = client_secrets

    @property
    def enabled(self) -> bool:
        return bool(self._owners) or self.store is not None

    def static_label(self, owner: str) -> str | None:
        """ "static-<n>" for the owner of the n-th key of `api_keys` (from 1), the name its
        metrics carry: the owner id is a hash of the key, which a public series should not
        offer to a dictionary. None for any other owner."""
        for n, known in enumerate(self._owners.values(), start=1):
            if known == owner:
                return f"static-{n}"
        return None

    def static_owner(self, key: str) -> str | None:
        found = None
        # compare against every key so the time taken does not tell which prefix matched
        for known, owner in self._owners.items():
            if key and hmac.compare_digest(key.encode(), known.encode()):
                found = owner
        return found

    # ------------------------------------------------------------ managed keys

    async def lookup(self, key: str) -> KeyRecord | None:
        """The managed record of `key` (None: unknown), from the cache when read in the last
        `cache_ttl_s`. GatewayError(busy) when the store fails and nothing recent is cached.
        A key not of a managed secret's form is unknown without a store read or a cache entry,
        so a flood of made-up keys neither reaches the store nor pushes real keys out of the
        cache."""
        if self.store is None or not MANAGED_FORM.fullmatch(key):
            return None
        digest = _digest(key)
        now = self._clock()
        cached = self._cache.get(digest)
        if cached is not None and now - cached[0] < self.cache_ttl_s:
            return cached[1]
        try:
            record = await self.store.by_digest(digest)
        except Exception as exc:
            if cached is not None and now - cached[0] < STALE_S:
                return cached[1]
            log.warning("key_store_unavailable", error=type(exc).__name__)
            raise GatewayError("busy", "API keys cannot be checked right now; retry") from None
        self._remember(digest, record, now)
        if (
            record is not None
            and digest not in self._scrubbed
            and len(self._scrubbed) < SCRUBBED_KEYS
        ):
            from gateway.telemetry import register_secrets

            self._scrubbed.add(digest)
            register_secrets([key])  # wherever a client puts it, it is redacted from logs
        return record

    def _remember(self, digest: str, record: KeyRecord | None, now: float) -> None:
        self._cache[digest] = (now, record)
        self._cache.move_to_end(digest)
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        if record is not None:
            self._records[record.id] = record
            self._records.move_to_end(record.id)
            while len(self._records) > CACHE_ENTRIES:
                self._records.popitem(last=False)

    def forget(self, key_id: str) -> None:
        """Drop what this process cached of a key (its revocation was just written here)."""
        for digest, (_, record) in list(self._cache.items()):
            if record is not None and record.id == key_id:
                del self._cache[digest]
        self._by_id.pop(key_id, None)

    def admit(self, record: KeyRecord | None) -> str:
        """The owner id of a managed record, or the GatewayError that refuses it."""
        if record is None:
            raise GatewayError("unauthorized", "missing or unknown API key")
        if record.revoked:
            raise GatewayError("api_key_revoked", "this API key was revoked")
        if record.expired():
            raise GatewayError("api_key_expired", "this API key has expired")
        if record.models is not None and self._served_model is not None:
            model = self._served_model()
            if model not in record.models:
                raise GatewayError("permission_denied", "this API key may not use this model")
        return record.id

    async def prefetch(self, headers: Mapping[str, str], subprotocols: Iterable[str] = ()) -> None:
        """Look a managed key up ahead of `owner()` (the middleware calls it once a request).
        Raises GatewayError(busy) when the store cannot be read."""
        key = key_of(headers, subprotocols)
        if self.store is None or not key or is_ephemeral(key) or self.static_owner(key) is not None:
            return
        record = await self.lookup(key)
        _prefetched.set((_digest(key), record))

    async def resolve(self, headers: Mapping[str, str], subprotocols: Iterable[str] = ()) -> str:
        """`owner()` for a caller outside a request the middleware saw (a periodic check)."""
        key = key_of(headers, subprotocols)
        static = self.static_owner(key) if key else None
        if static is not None or not self.enabled:
            return static or "anonymous"
        if is_ephemeral(key):
            raise GatewayError("permission_denied", EPHEMERAL_ONLY_REALTIME)
        return self.admit(await self.lookup(key))

    def limits_of(self, owner: str) -> KeyRecord | None:
        """The managed record behind an owner id, as last read (None: not a managed key)."""
        return self._records.get(owner)

    # ------------------------------------------------------------ the transports' entry

    def owner(self, headers: Mapping[str, str], subprotocols: Iterable[str] = ()) -> str:
        """The caller's owner id from `Authorization: Bearer <key>`, else (WebSocket only) from
        an offered `openai-insecure-api-key.<key>` subprotocol. GatewayError(unauthorized) when
        keys are configured and neither carries a known one; the message never holds the key."""
        if not self.enabled:
            return "anonymous"
        key = key_of(headers, subprotocols)
        found = self.static_owner(key)
        if found is not None:
            return found
        if is_ephemeral(key):  # whether or not it is a valid one: nothing is read for it
            raise GatewayError("permission_denied", EPHEMERAL_ONLY_REALTIME)
        if self.store is None or not key:
            raise GatewayError("unauthorized", "missing or unknown API key")
        digest = _digest(key)
        prefetched = _prefetched.get()
        if prefetched is not None and hmac.compare_digest(prefetched[0], digest):
            return self.admit(prefetched[1])
        cached = self._cache.get(digest)
        if cached is not None and self._clock() - cached[0] < self.cache_ttl_s:
            return self.admit(cached[1])
        raise GatewayError("unauthorized", "missing or unknown API key")

    # ------------------------------------------------------------ ephemeral keys

    def parent_of(self, headers: Mapping[str, str]) -> tuple[str, ParentKind, str]:
        """(owner id, parent kind, managed key id or "") of the key minting an ephemeral one:
        `owner()`'s checks (an ephemeral key may not mint another: permission_denied)."""
        owner = self.owner(headers)
        if not self.enabled:
            return owner, "anonymous", ""
        if self.static_owner(key_of(headers)) is not None:
            return owner, "static", ""
        return owner, "managed", owner

    async def lookup_id(self, key_id: str) -> KeyRecord | None:
        """A managed record by its id, cached as `lookup` caches by secret."""
        if self.store is None:
            return None
        now = self._clock()
        cached = self._by_id.get(key_id)
        if cached is not None and now - cached[0] < self.cache_ttl_s:
            return cached[1]
        try:
            record = await self.store.by_id(key_id)
        except Exception as exc:
            if cached is not None and now - cached[0] < STALE_S:
                return cached[1]
            log.warning("key_store_unavailable", error=type(exc).__name__)
            raise GatewayError("busy", "API keys cannot be checked right now; retry") from None
        self._by_id[key_id] = (now, record)
        self._by_id.move_to_end(key_id)
        while len(self._by_id) > CACHE_ENTRIES:
            self._by_id.popitem(last=False)
        if record is not None:
            self._records[record.id] = record  # its limits, for the rate limiter
        return record

    async def check_parent(self, secret: ClientSecret) -> str:
        """The owner id of an ephemeral key's parent if that key still stands, else the
        GatewayError that refuses it (the parent's own: revoked, expired, not allowed)."""
        if secret.parent_kind == "managed":
            return self.admit(await self.lookup_id(secret.parent_id))
        if secret.parent_kind == "static":
            if secret.owner in self._owners.values():
                return secret.owner
            raise GatewayError("unauthorized", "the key this ephemeral key was made with is gone")
        if self.enabled:  # minted while the gateway took no keys; it takes them now
            raise GatewayError("unauthorized", "missing or unknown API key")
        return "anonymous"

    async def grant(self, headers: Mapping[str, str], subprotocols: Iterable[str] = ()) -> Grant:
        """What a Realtime handshake may do: `owner()` for a real key; for an ephemeral one its
        record, refused when unknown (unauthorized), past its expiry (api_key_expired) or when
        its parent no longer stands."""
        key = key_of(headers, subprotocols)
        if not key or not is_ephemeral(key) or self.static_owner(key) is not None:
            return Grant(self.owner(headers, subprotocols))
        if self.client_secrets is None:
            raise GatewayError("unauthorized", "missing or unknown API key")
        try:
            secret = await self.client_secrets.get(_digest(key))
        except Exception as exc:
            log.warning("client_secret_store_unavailable", error=type(exc).__name__)
            raise GatewayError("busy", "API keys cannot be checked right now; retry") from None
        if secret is None:
            raise GatewayError("unauthorized", "missing or unknown API key")
        if secret.expired():
            raise GatewayError("api_key_expired", "this ephemeral key has expired; mint another")
        owner = await self.check_parent(secret)
        return Grant(owner, secret)
