"""Sessions' KV entries shared through Redis, written behind.

Every `put` is queued at once and written to Redis by a background thread (latest entry per key
wins, so a burst of turns writes once), with a TTL. The store keeps no KV in the process
beyond the writes still queued: the engine's prefix cache is its memory tier. `get` answers
from the queue (a write not yet made, or a delete), then from Redis, so the same replica after
its prefix cache let the session go, or another replica, continues the session without
prefilling it again.

Value layout (one Redis string per key, written atomically with `SET ... EX`):
`b"VGKV" | u32 header length | msgpack KVHeader | raw tensor bytes (k0, v0, k1, v1, ...)`.
Nothing is unpickled: the header is a msgspec Struct, tensors are rebuilt from raw bytes with
their recorded dtype and shapes. A value that does not decode, whose sizes disagree, or whose
block hashes do not match its tokens is a miss (logged), never an error.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import structlog
import torch

from gateway.engine.local.kv.blocks import KVEntry, block_hashes
from gateway.engine.local.kv.store import first_block_differs
from gateway.engine.local.prompt import ImageSpan

__all__ = ("KVHeader", "RedisKVStore", "decode_entry", "encode_entry")

log = structlog.get_logger(__name__)

# after a failed connect, the next attempt waits this long (a miss meanwhile)
RECONNECT_S = 5.0

_MAGIC = b"VGKV"
_LEN = struct.Struct("<I")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class KVHeader(msgspec.Struct, frozen=True):
    version: int
    seed: bytes  # model / dtype / block-size chain seed the hashes were made with
    block_size: int
    dtype: str
    shapes: list[list[int]]  # per tensor, in order k0, v0, k1, v1, ...: [1, Hkv, S, D]
    hashes: list[bytes]
    tokens: list[int]  # -1 at image positions
    images: list[tuple[int, int, str]]  # (start, length, key)
    body_hash: bytes  # blake2b of the tensor bytes: a flipped bit is a miss, not wrong KV


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(KVHeader)


class CorruptEntry(ValueError):
    pass


def _body_hash(body: bytes | bytearray) -> bytes:
    return hashlib.blake2b(body, digest_size=16).digest()


def encode_entry(entry: KVEntry, seed: bytes) -> bytes:
    tensors = [t for pair in entry.layers for t in pair]
    dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "float32"
    header = KVHeader(
        version=1,
        seed=seed,
        block_size=entry.block_size,
        dtype=dtype,
        shapes=[list(t.shape) for t in tensors],
        hashes=list(entry.hashes),
        tokens=list(entry.tokens),
        images=[(s.start, s.length, s.key) for s in entry.images],
        body_hash=b"",
    )
    # raw bytes as uint8 views, so every dtype (bfloat16 included) goes through numpy unchanged
    body = b"".join(
        t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes() for t in tensors
    )
    header = msgspec.structs.replace(header, body_hash=_body_hash(body))
    head = _header_encoder.encode(header)
    return _MAGIC + _LEN.pack(len(head)) + head + body


def decode_entry(raw: bytes, seed: bytes) -> KVEntry:
    """Rebuild an entry; raises `CorruptEntry` on anything inconsistent."""
    if len(raw) < 8 or raw[:4] != _MAGIC:
        raise CorruptEntry("bad magic")
    (head_len,) = _LEN.unpack_from(raw, 4)
    if 8 + head_len > len(raw):
        raise CorruptEntry("header length past the end")
    try:
        header = _header_decoder.decode(raw[8 : 8 + head_len])
    except msgspec.DecodeError as exc:
        raise CorruptEntry(f"header: {exc}") from None
    if header.version != 1 or header.seed != seed:
        raise CorruptEntry("written by another model, dtype or block size")
    dtype = _DTYPES.get(header.dtype)
    if dtype is None:
        raise CorruptEntry(f"dtype {header.dtype!r}")
    n = len(header.tokens)
    if len(header.shapes) % 2 or any(len(s) != 4 or s[2] != n or min(s) < 0 for s in header.shapes):
        raise CorruptEntry("tensor shapes disagree with the token count")
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [s[0] * s[1] * s[2] * s[3] * itemsize for s in header.shapes]
    body = bytearray(raw[8 + head_len :])
    if sum(sizes) != len(body):
        raise CorruptEntry(f"body is {len(body)} bytes, header says {sum(sizes)}")
    if _body_hash(body) != header.body_hash:
        raise CorruptEntry("tensor bytes do not match their hash")
    try:
        images = [ImageSpan(int(a), int(b), str(c)) for a, b, c in header.images]
    except (TypeError, ValueError):
        raise CorruptEntry("image spans") from None
    if block_hashes(header.tokens, images, header.block_size, seed) != header.hashes:
        raise CorruptEntry("block hashes do not match the tokens")
    tensors, offset = [], 0
    for shape, size in zip(header.shapes, sizes, strict=False):
        flat = (
            torch.frombuffer(body, dtype=torch.uint8, count=size, offset=offset)
            if size
            else torch.empty(0, dtype=torch.uint8)
        )
        tensors.append(flat.view(dtype).reshape(shape))
        offset += size
    layers = list(zip(tensors[0::2], tensors[1::2], strict=False))
    return KVEntry(list(header.tokens), images, header.block_size, list(header.hashes), layers)


class RedisKVStore:
    """Sessions' KV in Redis, written behind; see the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        seed: bytes,
        ttl_s: int = 3600,
        namespace: str = "visiongate:kv",
        device: str | torch.device = "cpu",
        socket_timeout_s: float = 5.0,
    ) -> None:
        from gateway.caching.redis_connections import sync_client

        # built on first use: a cluster client connects as it is made, and an unreachable Redis
        # at start must cost this store misses, not the engine's start
        self._connect = lambda: sync_client(
            url, socket_connect_timeout=min(socket_timeout_s, 2.0), socket_timeout=socket_timeout_s
        )
        self._redis: Any = None
        self._redis_lock = threading.Lock()
        self._retry_at = 0.0
        self._seed = seed
        self._ttl_s = ttl_s
        self._prefix = f"{namespace}:{seed.hex()[:16]}:"
        self._device = torch.device(device)
        self._pending: dict[str, KVEntry | None] = {}  # None: delete
        self._writing = 0
        self._cond = threading.Condition()
        self._closed = False
        self._writer = threading.Thread(
            target=self._write_loop, name="kv-redis-writer", daemon=True
        )
        self._writer.start()

    def _client(self) -> Any:
        """The Redis client, made on first use; after a failed attempt, the next is made no
        sooner than `RECONNECT_S` later (meanwhile each call fails at once: a miss)."""
        from redis.exceptions import ConnectionError as RedisConnectionError

        from gateway.caching.redis_connections import REDIS_FAILURES

        with self._redis_lock:
            if self._redis is None:
                if time.monotonic() < self._retry_at:
                    raise RedisConnectionError("Redis was unreachable moments ago")
                try:
                    self._redis = self._connect()
                except REDIS_FAILURES:
                    self._retry_at = time.monotonic() + RECONNECT_S
                    raise
            return self._redis

    def redis_key(self, key: str) -> str:
        return self._prefix + key

    def get(self, key: str, hashes: Sequence[bytes] | None = None) -> KVEntry | None:
        with self._cond:
            queued = key in self._pending
            entry = self._pending.get(key)
        if queued and entry is None:
            return None  # deleted; the delete is still on its way to Redis
        if entry is None:
            entry = self._load(key)
            if entry is None:
                return None
        if first_block_differs(entry.hashes, hashes):
            return None
        return entry

    def _load(self, key: str) -> KVEntry | None:
        from gateway.caching.redis_connections import REDIS_FAILURES

        try:
            raw = self._client().get(self.redis_key(key))
        except REDIS_FAILURES as exc:
            log.warning("kv.redis_unavailable", key=key, error=str(exc))
            return None
        if raw is None:
            return None
        try:
            entry = decode_entry(raw, self._seed)
        except CorruptEntry as exc:
            log.warning("kv.redis_corrupt", key=key, error=str(exc), nbytes=len(raw))
            return None
        if self._device.type != "cpu":
            entry.layers = [(k.to(self._device), v.to(self._device)) for k, v in entry.layers]
        log.info("kv.redis_loaded", key=key, positions=entry.length, nbytes=len(raw))
        return entry

    def put(self, key: str, entry: KVEntry) -> None:
        with self._cond:
            self._pending[key] = entry
            self._cond.notify_all()

    def delete(self, key: str) -> None:
        with self._cond:  # through the writer, so a write already in flight cannot undo it
            self._pending[key] = None
            self._cond.notify_all()

    def _write_loop(self) -> None:
        from gateway.caching.redis_connections import REDIS_FAILURES

        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                key = next(iter(self._pending))
                entry = self._pending.pop(key)
                self._writing += 1
            try:
                if entry is None:
                    self._client().delete(self.redis_key(key))
                else:
                    raw = encode_entry(entry, self._seed)
                    self._client().set(self.redis_key(key), raw, ex=self._ttl_s)
                    log.debug("kv.redis_written", key=key, nbytes=len(raw))
            except REDIS_FAILURES as exc:
                log.warning("kv.redis_write_failed", key=key, error=str(exc))
            except Exception:
                log.exception("kv.redis_write_failed", key=key)
            finally:
                with self._cond:
                    self._writing -= 1
                    self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._writing, timeout)

    def close(self) -> None:
        """Finish pending writes, then stop the writer."""
        self.flush(timeout=30.0)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._writer.join(timeout=30.0)
        if self._redis is not None:
            self._redis.close()
