"""Managed API keys at rest: records an operator creates, lists and revokes through the admin API.

A key's secret is `vgk-` and 43 URL-safe characters (256 random bits). It is handed out once, by
`KeyStore.create`'s caller; the store keeps only its SHA-256 digest (`secret_digest`), which
with that much entropy cannot be searched back to the secret, so no pepper is needed and a
Redis dump names no usable key. Nothing here logs a secret or a digest.

A record (`KeyRecord`) is immutable but for its revocation: limits are set when a key is made
(revoke and create another to change them). Its `id` (`key_` and 24 hex digits, the first 12
the creation time in ms) is the owner id of the key's sessions, rate limits and usage; `owner`
is the operator's label for whom the key belongs to (a customer, a team), never an identity.
Ids sort in creation order (to the millisecond), which is what listing pages by.

Two stores with one contract: `MemoryKeyStore` (one process) and `RedisKeyStore`, chosen as the
session store is (`make_key_store`: Redis when `redis_url` is set). Redis layout, namespace
`vg`, every key under the one hash tag `{vg-keys}`, so a create is one script on one node or
one Redis Cluster slot (a key store is small: thousands of records, not millions):
  `vg:{vg-keys}:r:<digest>`  the msgpack `KeyRecord` of the key whose secret has that digest
  `vg:{vg-keys}:i:<id>`      that digest, to reach a record by its id (the admin API)
  `vg:{vg-keys}:ids`         a sorted set of every id (score 0: ordered by id, paged by lex)
Usage counters are hashes of their own slot per key, `vg:key-usage:{<id>}` (the fields of
`KeyUsage`: `requests`, `input_tokens`, `cached_tokens`, `output_tokens`, `image_tokens`,
`encode_ms`), so counting spreads over a cluster's shards, and the same counts per UTC day in
`vg:key-usage:{<id>}:<YYYYMMDD>` (same slot, kept `USAGE_DAYS_KEPT` days) for the usage of a
period. The totals count from the key's creation on; the windows of its token limits are
`gateway.policy.token_limits`'.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import secrets
import time
from bisect import bisect_right, insort
from typing import Literal, Protocol

import msgspec

__all__ = (
    "KEY_ID",
    "SECRET_PREFIX",
    "USAGE_DAYS_KEPT",
    "USAGE_FIELDS",
    "KeyRecord",
    "KeyStore",
    "KeyUsage",
    "MemoryKeyStore",
    "RedisKeyStore",
    "make_key_store",
    "new_key_id",
    "new_secret",
    "secret_digest",
    "usage_day",
)

SECRET_PREFIX = "vgk-"
KEY_ID = re.compile(r"key_[0-9a-f]{24}")
Period = Literal["day", "month"]


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def secret_digest(secret: str) -> str:
    """What the store keeps of a secret: its SHA-256, hex."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def new_key_id(now: float | None = None) -> str:
    """`key_` + 12 hex digits of the time in ms + 12 random ones: unique, sorted by creation."""
    ms = int((time.time() if now is None else now) * 1000)
    return f"key_{ms:012x}{secrets.token_hex(6)}"


class KeyRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    name: str
    owner: str = ""
    created: float  # unix seconds
    # the last 4 characters of the secret, for people to tell keys apart ("vgk-...x9Zq")
    hint: str = ""
    expires_at: float | None = None  # unix seconds; None: never
    models: list[str] | None = None  # None: every model the gateway serves
    rpm: int | None = None  # responses per minute; None: the gateway's rate_limit_per_minute
    # token limits (gateway.policy.token_limits); None: none of that kind
    input_tpm: int | None = None  # input tokens per minute
    output_tpm: int | None = None  # output tokens per minute
    budget_tokens: int | None = None  # input + output tokens per `budget_period`
    budget_period: Period | None = None  # the UTC day or calendar month; set with budget_tokens
    # responses in flight at once, on all replicas; None: the gateway's
    # max_concurrent_responses_per_key; 0: no cap
    max_concurrent: int | None = None
    revoked: bool = False
    revoked_at: float | None = None

    def expired(self, now: float | None = None) -> bool:
        return (
            self.expires_at is not None and (time.time() if now is None else now) >= self.expires_at
        )


USAGE_FIELDS = (
    "requests",
    "input_tokens",
    "cached_tokens",
    "output_tokens",
    "image_tokens",
    "encode_ms",
)


USAGE_DAYS_KEPT = 400  # per-day usage counts kept this long (a year and a month's margin)


def usage_day(now: float | None = None) -> str:
    """The UTC day a count at unix time `now` goes to, as `YYYYMMDD`."""
    return dt.datetime.fromtimestamp(time.time() if now is None else now, dt.UTC).strftime("%Y%m%d")


class KeyUsage(msgspec.Struct):
    """A key's counts since it was made: responses started, and the tokens of those that
    ended (input includes cached and image tokens), and the ms they waited for encodes."""

    id: str
    requests: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    image_tokens: int = 0
    encode_ms: int = 0


_encode = msgspec.msgpack.Encoder().encode
_decode_record = msgspec.msgpack.Decoder(KeyRecord).decode


class KeyStore(Protocol):
    async def create(self, record: KeyRecord, digest: str) -> None:
        """Store a new record under the digest of its secret (ValueError when one is there)."""

    async def by_digest(self, digest: str) -> KeyRecord | None:
        """The record whose secret has this digest, revoked or expired ones included."""

    async def by_id(self, key_id: str) -> KeyRecord | None: ...

    async def page(self, after: str | None, limit: int) -> list[KeyRecord]:
        """Up to `limit` records with ids after `after` (None: from the first), oldest first."""

    async def revoke(self, key_id: str, at: float) -> KeyRecord | None:
        """Mark revoked (idempotent: a second revoke keeps the first time); None: no such id."""

    async def count_usage(self, key_id: str, **counts: int) -> None:
        """Add to the key's counters (names: `USAGE_FIELDS`): its totals and today's."""

    async def usage(self, key_ids: list[str], days: list[str] | None = None) -> list[KeyUsage]:
        """Each key's totals, or with `days` (`YYYYMMDD`) the sum of those days' counts."""

    async def aclose(self) -> None: ...


class MemoryKeyStore:
    """One process's keys (the embedded default): gone at restart, like memory sessions."""

    __slots__ = ("_by_digest", "_digests", "_ids", "_usage")

    def __init__(self) -> None:
        self._by_digest: dict[str, bytes] = {}  # encoded, so callers never share a record
        self._digests: dict[str, str] = {}  # id -> digest
        self._ids: list[str] = []  # sorted
        self._usage: dict[str, list[int]] = {}

    async def create(self, record: KeyRecord, digest: str) -> None:
        if digest in self._by_digest or record.id in self._digests:
            raise ValueError("key exists")
        self._by_digest[digest] = _encode(record)
        self._digests[record.id] = digest
        insort(self._ids, record.id)

    async def by_digest(self, digest: str) -> KeyRecord | None:
        raw = self._by_digest.get(digest)
        return None if raw is None else _decode_record(raw)

    async def by_id(self, key_id: str) -> KeyRecord | None:
        digest = self._digests.get(key_id)
        return None if digest is None else await self.by_digest(digest)

    async def page(self, after: str | None, limit: int) -> list[KeyRecord]:
        start = 0 if after is None else bisect_right(self._ids, after)
        out = []
        for key_id in self._ids[start : start + limit]:
            record = await self.by_id(key_id)
            if record is not None:
                out.append(record)
        return out

    async def revoke(self, key_id: str, at: float) -> KeyRecord | None:
        record = await self.by_id(key_id)
        if record is None:
            return None
        if not record.revoked:
            record = msgspec.structs.replace(record, revoked=True, revoked_at=at)
            self._by_digest[self._digests[key_id]] = _encode(record)
        return record

    async def count_usage(self, key_id: str, **counts: int) -> None:
        for bucket in (key_id, f"{key_id}:{usage_day()}"):
            held = self._usage.setdefault(bucket, [0] * len(USAGE_FIELDS))
            for i, field in enumerate(USAGE_FIELDS):
                held[i] += int(counts.get(field, 0))

    async def usage(self, key_ids: list[str], days: list[str] | None = None) -> list[KeyUsage]:
        if days is None:
            return [KeyUsage(k, *self._usage.get(k, ())) for k in key_ids]
        out = []
        for k in key_ids:
            rows = [self._usage.get(f"{k}:{day}", [0] * len(USAGE_FIELDS)) for day in days]
            out.append(KeyUsage(k, *(sum(col) for col in zip(*rows, strict=True))))
        return out

    async def aclose(self) -> None:
        return None


# KEYS: record, id -> digest, id index. ARGV: encoded record, digest, id. 0: a record exists.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], 0, ARGV[3])
return 1
"""


class RedisKeyStore:
    """Keys shared by every gateway replica on one Redis or Redis Cluster (layout above)."""

    __slots__ = ("_create", "_prefix", "_redis", "namespace")

    def __init__(self, redis_url: str, namespace: str = "vg") -> None:
        from gateway.caching.redis_connections import async_client

        self.namespace = namespace
        self._prefix = f"{namespace}:{{vg-keys}}"
        self._redis = async_client(redis_url, socket_connect_timeout=2.0, socket_timeout=2.0)
        self._create = self._redis.register_script(_CREATE)

    def _usage_key(self, key_id: str) -> str:
        return f"{self.namespace}:key-usage:{{{key_id}}}"

    async def create(self, record: KeyRecord, digest: str) -> None:
        keys = [
            f"{self._prefix}:r:{digest}",
            f"{self._prefix}:i:{record.id}",
            f"{self._prefix}:ids",
        ]
        if not int(await self._create(keys=keys, args=[_encode(record), digest, record.id])):
            raise ValueError("key exists")

    async def by_digest(self, digest: str) -> KeyRecord | None:
        raw = await self._redis.get(f"{self._prefix}:r:{digest}")
        return None if raw is None else _decode_record(raw)

    async def by_id(self, key_id: str) -> KeyRecord | None:
        digest = await self._redis.get(f"{self._prefix}:i:{key_id}")
        return None if digest is None else await self.by_digest(digest.decode())

    async def page(self, after: str | None, limit: int) -> list[KeyRecord]:
        low = "-" if after is None else f"({after}"
        ids = await self._redis.zrangebylex(f"{self._prefix}:ids", low, "+", start=0, num=limit)
        out = []
        for key_id in ids:
            record = await self.by_id(key_id.decode())
            if record is not None:
                out.append(record)
        return out

    async def revoke(self, key_id: str, at: float) -> KeyRecord | None:
        digest = await self._redis.get(f"{self._prefix}:i:{key_id}")
        if digest is None:
            return None
        key = f"{self._prefix}:r:{digest.decode()}"
        raw = await self._redis.get(key)
        if raw is None:
            return None
        record = _decode_record(raw)
        if not record.revoked:  # a record changes only this way: last writer is as good as first
            record = msgspec.structs.replace(record, revoked=True, revoked_at=at)
            await self._redis.set(key, _encode(record))
        return record

    async def count_usage(self, key_id: str, **counts: int) -> None:
        total = self._usage_key(key_id)
        today = f"{total}:{usage_day()}"
        pipe = self._redis.pipeline(transaction=False)
        for field in USAGE_FIELDS:
            n = int(counts.get(field, 0))
            if n:
                pipe.hincrby(total, field, n)
                pipe.hincrby(today, field, n)
        if len(pipe):
            pipe.expire(today, USAGE_DAYS_KEPT * 86400)
            await pipe.execute()

    async def usage(self, key_ids: list[str], days: list[str] | None = None) -> list[KeyUsage]:
        out = []
        for key_id in key_ids:
            base = self._usage_key(key_id)
            buckets = [base] if days is None else [f"{base}:{day}" for day in days]
            pipe = self._redis.pipeline(transaction=False)
            for bucket in buckets:
                pipe.hgetall(bucket)
            sums = dict.fromkeys(USAGE_FIELDS, 0)
            for got in await pipe.execute():
                for k, v in got.items():
                    if k.decode() in sums:
                        sums[k.decode()] += int(v)
            out.append(KeyUsage(key_id, *(sums[f] for f in USAGE_FIELDS)))
        return out

    async def aclose(self) -> None:
        await self._redis.aclose()


def make_key_store(redis_url: str | None) -> KeyStore:
    """On the session store's backend: in-process without a Redis URL, else Redis."""
    return MemoryKeyStore() if redis_url is None else RedisKeyStore(redis_url)
