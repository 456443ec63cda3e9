"""Where gateways and encoder workers meet in Redis: the key layout and the stored values.

Keys (namespace `vg`; the gateway's caches may be given another, the job queue may not):

    vg:encode:jobs              stream of jobs of the deployment "default", read by the consumer
                                group `encoders`; entry field `job` = msgpack `EncodeJob` (jobs.py)
    vg:encode:jobs:{deployment} the same for any other deployment: gateways and workers of one
                                deployment share a stream, other deployments never see it
    vg:encode:spec:{fingerprint}
                                JSON `EncoderSpec` (jobs.py): what a gateway encodes with, so its
                                workers adopt it instead of having it copied into their flags
    vg:encode:current:{deployment}
                                the fingerprint the deployment's gateways encode with now: set by
                                each gateway as it starts, followed by the deployment's workers
    vg:encode:workers:{deployment}:{fingerprint}
                                sorted set of the workers serving that encoder, scored by the
                                Redis server's clock (seconds) at their last heartbeat, every
                                `HEARTBEAT_S`; a worker unseen for `WORKER_LIVE_S` counts as gone
    vg:encode:dead              dead-letter stream; fields `job`, `reason`, `consumer`, `attempts`
    vg:encode:result:{job_id}   list the worker RPUSHes one msgpack `EncodeResult` onto (short
                                TTL); the caller BLPOPs it
    vg:image:{digest}           the image bytes, as they came (the gateway's image store)
    vg:vision:{fingerprint}:{digest}
                                the visual tokens (the gateway's vision cache): `redis_value` of
                                a `pack_encoded` entry
    vg:owner:{owner}:{digest}   the gateway's ownership index: the API key `owner` (its id, never
                                the key) sent these bytes; b"sent", or b"used" once that key has
                                been given the image's tokens; the vision cache's TTL, refreshed
                                on use

Every command, script and MULTI/EXEC names keys of one hash slot, so the layout serves one Redis
and a Redis Cluster (`redis+cluster://`, `encoder_worker.redis_conn`) alike; keys that are read
or written together are reached by separate commands, in an order that keeps a job delivered
at least once:

    gateway, per image      PEXPIRE or SET vg:image:{digest}; XLEN + XADD on the job stream;
                            BLPOP vg:encode:result:{job_id} (in slices shorter than the socket
                            timeout); GET vg:vision:{fingerprint}:{digest}
    gateway, start          XGROUP CREATE on the job stream; SET the spec, SET ... GET the
                            current pointer; a one-key script counts live workers (ZCOUNT)
    worker, heartbeat       a one-key script on the workers' set (ZADD, ZREMRANGEBYSCORE,
                            EXPIRE), then GET the current pointer
    worker, reading         XAUTOCLAIM / XREADGROUP / XPENDING / XCLAIM on the job stream;
                            one GET per image key, in a non-transactional pipeline
    worker, committing      1. SET vg:vision:... per encoded image, XADD vg:encode:dead per
                               dead letter (a non-transactional pipeline of one-key commands)
                            2. RPUSH + EXPIRE vg:encode:result:{job_id} per job
                            3. MULTI: XADD of requeued jobs, XACK + XDEL of the batch, all on
                               the job stream; a crash before it leaves the jobs pending, to be
                               reclaimed and run again (`batch_commit`)

When the gateway does not share encodes across API keys, its image store and vision cache key an
image by `scoped_digest(owner, digest)` instead of its digest (`vg:image:{scoped}`,
`vg:vision:{fingerprint}:{scoped}`), so each key's entries are its own; workers never see those
keys (jobs carry the real digest).

A vision-cache value is framed twice. `redis_value` wraps any payload as msgpack
`[crc32, payload]`, so a damaged value reads as a miss instead of reaching a decoder. The
payload the vision cache holds is a `pack_encoded` entry:

    b"VGV1" | u32 little-endian header length | msgpack header | tokens

with the header naming the image, the encoder, the token counts, the stage timings and, for a
real VLM checkpoint, the image's `ImageLayout`, and `tokens` the payload in its INT4 or float
form (`encoder_worker.payload`). `unpack_encoded` checks all of it and never unpickles.

This module holds formats only: no Redis client, no I/O.
"""

from __future__ import annotations

import hashlib
import re
import struct
import zlib

import msgspec

from encoder_worker.types import EncodedImage, ImageLayout

__all__ = (
    "DEAD_STREAM",
    "DEFAULT_DEPLOYMENT",
    "GROUP",
    "HEARTBEAT_S",
    "JOBS_STREAM",
    "NAMESPACE",
    "WORKER_LIVE_S",
    "check_deployment",
    "current_spec_key",
    "image_key",
    "jobs_stream",
    "owner_key",
    "pack_encoded",
    "read_redis_value",
    "redis_value",
    "result_key",
    "scoped_digest",
    "spec_key",
    "unpack_encoded",
    "vision_key",
    "workers_key",
)

NAMESPACE = "vg"
JOBS_STREAM = f"{NAMESPACE}:encode:jobs"
DEAD_STREAM = f"{NAMESPACE}:encode:dead"
GROUP = "encoders"
DEFAULT_DEPLOYMENT = "default"
HEARTBEAT_S = 2.0  # a worker's heartbeat period
WORKER_LIVE_S = 10  # ... and how long after its last one it still counts as serving

_DEPLOYMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_deployment(name: str) -> str:
    """`name` if it may name a deployment (1-64 of letters, digits, `_`, `.`, `-`), else
    ValueError: it becomes part of Redis keys."""
    if not isinstance(name, str) or not _DEPLOYMENT.fullmatch(name):
        raise ValueError(
            f"deployment name {name!r}: use 1-64 letters, digits, '_', '.' or '-' "
            "(starting with a letter or digit)"
        )
    return name


def jobs_stream(deployment: str = DEFAULT_DEPLOYMENT) -> str:
    """The job stream a deployment's gateways write and its workers read."""
    if deployment == DEFAULT_DEPLOYMENT:
        return JOBS_STREAM
    return f"{JOBS_STREAM}:{check_deployment(deployment)}"


def spec_key(fingerprint: str) -> str:
    """Where the `EncoderSpec` of the encoder with this fingerprint is published."""
    return f"{NAMESPACE}:encode:spec:{fingerprint}"


def current_spec_key(deployment: str = DEFAULT_DEPLOYMENT) -> str:
    """The deployment's pointer to the fingerprint its gateways encode with now."""
    return f"{NAMESPACE}:encode:current:{check_deployment(deployment)}"


def workers_key(deployment: str, fingerprint: str) -> str:
    """The heartbeats of the deployment's workers that serve the encoder `fingerprint`."""
    return f"{NAMESPACE}:encode:workers:{check_deployment(deployment)}:{fingerprint}"


def result_key(job_id: str) -> str:
    """The list one job's `EncodeResult` is pushed onto."""
    return f"{NAMESPACE}:encode:result:{job_id}"


def image_key(digest: str, namespace: str = NAMESPACE) -> str:
    """The image store's key for the bytes with this sha256 hex digest."""
    return f"{namespace}:image:{digest}"


def vision_key(fingerprint: str, digest: str, namespace: str = NAMESPACE) -> str:
    """The vision cache's key for the tokens of this image under this encoder."""
    return f"{namespace}:vision:{fingerprint}:{digest}"


def owner_key(owner: str, digest: str, namespace: str = NAMESPACE) -> str:
    """The ownership index's key: the API key whose id is `owner` sent the image `digest`."""
    return f"{namespace}:owner:{owner}:{digest}"


def scoped_digest(owner: str, digest: str) -> str:
    """The name an image's bytes and tokens are stored under when encodes are not shared
    across API keys: sha256 over the owner id and the digest (64 lowercase hex characters,
    like a digest, so every store takes it unchanged)."""
    return hashlib.sha256(f"visiongate-owner\0{owner}\0{digest}".encode()).hexdigest()


# -- the Redis value of a vision-cache entry --------------------------------------------------


class _StoredTokens(msgspec.Struct, array_like=True):
    crc32: int
    payload: bytes


_value_encoder = msgspec.msgpack.Encoder()
_value_decoder = msgspec.msgpack.Decoder(_StoredTokens)


def redis_value(payload: bytes) -> bytes:
    """The Redis value stored for a vision-cache payload: msgpack [crc32, payload]."""
    return _value_encoder.encode(_StoredTokens(zlib.crc32(payload), bytes(payload)))


def read_redis_value(raw: bytes) -> bytes:
    """Inverse of `redis_value`; ValueError if the value does not decode or fails its checksum."""
    try:
        stored = _value_decoder.decode(raw)
    except msgspec.MsgspecError as exc:
        raise ValueError(str(exc)) from None
    if zlib.crc32(stored.payload) != stored.crc32:
        raise ValueError("checksum mismatch")
    return stored.payload


# -- the vision-cache entry -------------------------------------------------------------------


class _CachedHeader(msgspec.Struct, array_like=True):
    digest: str
    fingerprint: str
    tokens_kept: int
    tokens_total: int
    hidden_size: int
    timings_ms: dict[str, float]
    # real VLM checkpoints: where the rows go in the prompt; entries written before layouts
    # existed end after timings_ms and read as None
    layout: ImageLayout | None = None


_MAGIC = b"VGV1"
_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_CachedHeader)


def pack_encoded(image: EncodedImage) -> bytes:
    """EncodedImage -> a vision-cache entry: magic, header length, msgpack header (with the
    layout, if any), payload (INT4 or float form)."""
    header = _header_encoder.encode(
        _CachedHeader(
            image.digest,
            image.fingerprint,
            image.tokens_kept,
            image.tokens_total,
            image.hidden_size,
            {k: float(v) for k, v in image.timings_ms.items()},
            image.layout,
        )
    )
    return b"".join((_MAGIC, struct.pack("<I", len(header)), header, image.payload.to_bytes()))


def unpack_encoded(data: bytes) -> EncodedImage:
    """Inverse of pack_encoded; ValueError on anything malformed (never unpickles)."""
    from encoder_worker.payload import payload_from_bytes

    if len(data) < 8 or data[:4] != _MAGIC:
        raise ValueError("not a visiongate vision-cache entry")
    (n,) = struct.unpack_from("<I", data, 4)
    if 8 + n > len(data):
        raise ValueError("truncated vision-cache entry")
    try:
        header = _header_decoder.decode(data[8 : 8 + n])
    except msgspec.MsgspecError as exc:
        raise ValueError(f"bad vision-cache header: {exc}") from None
    payload = payload_from_bytes(data[8 + n :])
    if payload.header.n_tokens != header.tokens_kept or payload.header.hidden != header.hidden_size:
        raise ValueError("vision-cache entry header does not match its tokens")
    if header.layout is not None and header.layout.rows != header.tokens_kept:
        raise ValueError(
            f"vision-cache entry layout places {header.layout.rows} rows, "
            f"it holds {header.tokens_kept}"
        )
    return EncodedImage(
        digest=header.digest,
        fingerprint=header.fingerprint,
        tokens_kept=header.tokens_kept,
        tokens_total=header.tokens_total,
        hidden_size=header.hidden_size,
        payload=payload,
        timings_ms=header.timings_ms,
        layout=header.layout,
    )
