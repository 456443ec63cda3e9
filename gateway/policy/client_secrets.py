"""Ephemeral Realtime keys ("client secrets"): short-lived secrets minted with a real key.

A server holding a real API key (static or managed) calls `POST /v1/realtime/client_secrets`
and hands the answer's `value` to a browser, which opens `/v1/realtime` with it; the browser
never holds the real key. A secret is `ek_` and 43 URL-safe characters (256 random bits).

What a secret is bound to (`ClientSecret`): its parent's owner id, so the sessions it opens,
the rate limits and the usage counted are the parent's; the parent itself (`parent_kind`
"static", "managed" with `parent_id` its key id, or "anonymous" on a gateway without keys),
checked again at every connect and while the connection is open, so a revoked or expired parent
ends its ephemeral keys and their connections; and optionally the session settings (the JSON of
a Realtime `session` object, checked when minted) that the connection applies once its session
is open.

Invariants:
- only the SHA-256 of a secret is stored (`secret_digest`), as for managed keys; nothing here
  logs a secret or a digest;
- a secret opens Realtime WebSockets only, never an HTTP API (`gateway.policy.auth` refuses it
  there with `permission_denied`, before any store read);
- a secret connects until `expires_at`; after that it is refused with `api_key_expired`. A
  connection opened in time lives on as long as its parent key stands (as OpenAI's Realtime
  sessions do). The record is kept `EXPIRED_KEPT_S` past its expiry so a late client hears
  `api_key_expired` rather than `unauthorized`; then the store forgets it (TTL);
- the store is on the session store's backend: in-process (`MemoryClientSecretStore`, at most
  `MAX_MEMORY_SECRETS` live records of `MAX_MEMORY_BYTES` in all) or Redis
  (`RedisClientSecretStore`), one key per secret, `vg:client-secret:<digest>`, set with its TTL
  in one command: single-key operations only, so a Redis Cluster serves it unchanged;
- one owner mints at most `MAX_MINTS_PER_MINUTE` a minute (past that `rate_limited`), whatever
  its rate limit (a mint is also one request of it), so what a store holds is bounded by
  owners x that rate x the longest lifetime. Redis counts in one key per owner and minute,
  `vg:client-secret-mints:<owner>:<minute>`, expiring after two minutes.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Literal, Protocol

import msgspec

from gateway.policy.key_store import secret_digest
from gateway.protocol.errors import GatewayError

__all__ = (
    "DEFAULT_TTL_S",
    "EPHEMERAL_PREFIX",
    "EXPIRED_KEPT_S",
    "MAX_MEMORY_BYTES",
    "MAX_MEMORY_SECRETS",
    "MAX_MINTS_PER_MINUTE",
    "MAX_TTL_S",
    "MIN_TTL_S",
    "ClientSecret",
    "ClientSecretStore",
    "MemoryClientSecretStore",
    "RedisClientSecretStore",
    "is_ephemeral",
    "make_client_secret_store",
    "new_client_secret",
    "secret_digest",
)

EPHEMERAL_PREFIX = "ek_"
DEFAULT_TTL_S = 60  # when the request names no expires_after.seconds
MIN_TTL_S = 10
MAX_TTL_S = 7200  # two hours, as OpenAI's
EXPIRED_KEPT_S = 300
MAX_MEMORY_SECRETS = 100_000  # live records of one process; past that minting answers busy
MAX_MEMORY_BYTES = 256 * 1024 * 1024  # and their encoded bytes (session settings may be large)
MAX_MINTS_PER_MINUTE = 600  # per owner


def _too_many(now: float) -> GatewayError:
    return GatewayError(
        "rate_limited",
        f"at most {MAX_MINTS_PER_MINUTE} ephemeral keys a minute per key",
        retry_after_s=60.0 - now % 60.0,
    )


ParentKind = Literal["static", "managed", "anonymous"]


def new_client_secret() -> str:
    return EPHEMERAL_PREFIX + secrets.token_urlsafe(32)


def is_ephemeral(key: str) -> bool:
    """Whether a presented key has the form of an ephemeral one (says nothing of its validity)."""
    return key.startswith(EPHEMERAL_PREFIX)


class ClientSecret(msgspec.Struct, kw_only=True, omit_defaults=True):
    owner: str  # the parent key's owner id
    parent_kind: ParentKind
    parent_id: str = ""  # the managed key's id (parent_kind "managed")
    created_at: float  # unix seconds
    expires_at: float  # unix seconds
    session: bytes = b""  # the JSON of the Realtime session settings to apply; b"": none

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(ClientSecret).decode


class ClientSecretStore(Protocol):
    async def put(self, digest: str, secret: ClientSecret) -> None:
        """Store a new record under its secret's digest, kept until `EXPIRED_KEPT_S` past its
        expiry. GatewayError(busy) when it cannot be stored."""

    async def get(self, digest: str) -> ClientSecret | None:
        """The record (expired ones included, until forgotten); None: unknown."""

    async def aclose(self) -> None: ...


class MemoryClientSecretStore:
    """One process's ephemeral keys: a dict with deadlines, bounded in size."""

    __slots__ = ("_bytes", "_clock", "_mints", "_records", "max_bytes", "max_records")

    def __init__(
        self,
        *,
        max_records: int = MAX_MEMORY_SECRETS,
        max_bytes: int = MAX_MEMORY_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._records: dict[str, tuple[float, bytes]] = {}  # digest -> (forget at, record)
        self._bytes = 0
        self._mints: dict[str, tuple[int, int]] = {}  # owner -> (minute, mints in it)
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._clock = clock

    def _full(self, size: int) -> bool:
        return len(self._records) >= self.max_records or self._bytes + size > self.max_bytes

    def _drop(self, digest: str) -> None:
        self._bytes -= len(self._records.pop(digest)[1])

    async def put(self, digest: str, secret: ClientSecret) -> None:
        now = self._clock()
        minute = int(now // 60)
        if len(self._mints) > self.max_records:  # owners of past minutes
            self._mints = {o: m for o, m in self._mints.items() if m[0] == minute}
        last, count = self._mints.get(secret.owner, (minute, 0))
        count = count + 1 if last == minute else 1
        if count > MAX_MINTS_PER_MINUTE:
            raise _too_many(now)
        self._mints[secret.owner] = (minute, count)
        raw = _encode(secret)
        if self._full(len(raw)):
            for old in [d for d, (until, _) in self._records.items() if until <= now]:
                self._drop(old)
            if self._full(len(raw)):
                raise GatewayError("busy", "too many ephemeral keys are live; retry later")
        if digest in self._records:
            self._drop(digest)
        self._records[digest] = (secret.expires_at + EXPIRED_KEPT_S, raw)
        self._bytes += len(raw)

    async def get(self, digest: str) -> ClientSecret | None:
        entry = self._records.get(digest)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            self._drop(digest)
            return None
        return _decode(entry[1])

    def __len__(self) -> int:
        return len(self._records)

    async def aclose(self) -> None:
        self._records.clear()
        self._bytes = 0


class RedisClientSecretStore:
    """Ephemeral keys shared by every replica: one `SET ... EX` per mint, one `GET` per use."""

    __slots__ = ("_redis", "namespace")

    def __init__(self, redis_url: str, namespace: str = "vg") -> None:
        from gateway.caching.redis_connections import async_client

        self.namespace = namespace
        self._redis = async_client(redis_url, socket_connect_timeout=2.0, socket_timeout=2.0)

    def _key(self, digest: str) -> str:
        return f"{self.namespace}:client-secret:{digest}"

    async def put(self, digest: str, secret: ClientSecret) -> None:
        now = time.time()
        ttl = max(1, int(secret.expires_at - now + EXPIRED_KEPT_S))
        mints = f"{self.namespace}:client-secret-mints:{secret.owner}:{int(now // 60)}"
        try:
            count = int(await self._redis.incr(mints))
            if count == 1:
                await self._redis.expire(mints, 120)
            if count > MAX_MINTS_PER_MINUTE:
                raise _too_many(now)
            await self._redis.set(self._key(digest), _encode(secret), ex=ttl, nx=True)
        except GatewayError:
            raise
        except Exception as exc:
            raise GatewayError(
                "busy", f"ephemeral keys cannot be stored right now ({type(exc).__name__})"
            ) from None

    async def get(self, digest: str) -> ClientSecret | None:
        raw = await self._redis.get(self._key(digest))
        return None if raw is None else _decode(raw)

    async def aclose(self) -> None:
        await self._redis.aclose()


def make_client_secret_store(redis_url: str | None) -> ClientSecretStore:
    """On the session store's backend: in-process without a Redis URL, else Redis."""
    return MemoryClientSecretStore() if redis_url is None else RedisClientSecretStore(redis_url)
