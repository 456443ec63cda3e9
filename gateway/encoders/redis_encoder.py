"""`RedisEncoder`: the gateway's `Encoder` when the encoding runs in encoder worker processes.

No model is loaded here. `start()` publishes what this gateway encodes with (`EncoderSpec`:
the encoder settings, the engine's hidden size and embedding RMS in the dtype it runs, the
fingerprint) and points its deployment at it, so workers adopt it rather than have it copied
into their flags; while it runs it puts both back if Redis lost them, without taking the pointer
from another gateway that has since replaced it. Workers report themselves live under their
encoder's fingerprint (`live_workers`, which `/readyz` asks).

`encode()` makes sure the bytes are in the image store (`vg:image:{digest}`), XADDs an
`EncodeJob` to the deployment's job stream (`vg:encode:jobs` for the default one), and waits
with BLPOP on the job's result list `vg:encode:result:{job_id}`; on `done` it reads the tokens
the worker put in the vision cache (keys and stored values: `encoder_worker.storage`). A list
rather than pub/sub because a notice pushed before the caller starts waiting (or while its
connection is being re-established) is kept, not lost; the price is one Redis connection per
image being waited for, which the gateway's single-flight per digest keeps to the number of
distinct images in flight. The wait is a series of BLPOPs of at most `_WAIT_SLICE_S` each, so
no reply takes longer than the client's socket timeout: a longer BLPOP would trip it, and a
cluster client would then rediscover the cluster and send the BLPOP again. Every command names
one key, so the Redis setting may be one node or a Redis Cluster (`redis+cluster://`).

Errors: a bad image raises `ImageError` with the worker's code; no answer within `timeout_s`,
Redis unreachable, or a worker serving another encoder (`encoder_mismatch`: this gateway's
configuration is no longer its deployment's) raises `GatewayError("busy")`; a job the workers
gave up on (it is in `vg:encode:dead`) raises `GatewayError("internal_error")` with the dead
letter's reason. A job whose caller timed out is still encoded later, and its tokens still land
in the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import TYPE_CHECKING

import structlog

from encoder_worker.jobs import (
    ENCODER_MISMATCH,
    IMAGE_ERROR_CODES,
    EncodeDone,
    EncodeJob,
    decode_result,
    decode_spec,
    encode_job,
    encode_spec,
    make_spec,
)
from encoder_worker.pipeline import encoder_fingerprint
from encoder_worker.storage import (
    DEFAULT_DEPLOYMENT,
    WORKER_LIVE_S,
    current_spec_key,
    image_key,
    jobs_stream,
    read_redis_value,
    result_key,
    spec_key,
    unpack_encoded,
    vision_key,
    workers_key,
)
from encoder_worker.types import EncodedImage, ImageError
from gateway.caching.redis_connections import REDIS_FAILURES, async_client
from gateway.policy.fair_gate import FairGate

if TYPE_CHECKING:
    from redis.asyncio import Redis, RedisCluster

    from encoder_worker.config import EncoderConfig
    from encoder_worker.jobs import EncoderSpec

__all__ = ("RedisEncoder", "live_workers")

log = structlog.get_logger("gateway.encoders.redis_encoder")

# workers of one encoder seen within the last ARGV[1] s, by the Redis server's clock (the one
# their heartbeats are scored by)
_LIVE_WORKERS = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1000000
return redis.call('ZCOUNT', KEYS[1], t - tonumber(ARGV[1]), '+inf')
"""
_REPUBLISH_S = 5.0
# one BLPOP waits at most this long; the socket timeout leaves room for its reply
_WAIT_SLICE_S = 5.0
_SOCKET_TIMEOUT_S = _WAIT_SLICE_S + 5.0


async def live_workers(client: Redis | RedisCluster, deployment: str, fingerprint: str) -> int:
    """Workers of `deployment` that serve the encoder `fingerprint` and were heard from within
    `WORKER_LIVE_S`."""
    count = await client.eval(_LIVE_WORKERS, 1, workers_key(deployment, fingerprint), WORKER_LIVE_S)
    return int(count)


class RedisEncoder:
    """Encoder protocol implementation that queues jobs for `visiongate worker` processes.

    `config`, `hidden_size` and `target_rms` make the fingerprint the tokens are cached under
    (for a VLM checkpoint only `config` counts, see `encoder_fingerprint`); `start()`
    publishes them for the `deployment`'s workers to adopt. `max_stream_len` caps the job
    stream (past it, encode answers busy): a safety valve for a queue no worker drains, not a
    tuning knob.
    """

    # encodes in worker processes, which record their own stage spans (under the job's
    # traceparent) and write the vision cache themselves
    remote = True

    def __init__(
        self,
        redis_url: str,
        config: EncoderConfig,
        hidden_size: int,
        target_rms: float | None = None,
        *,
        timeout_s: float = 60.0,
        image_ttl_s: float = 86400.0,
        vision_ttl_s: float = 86400.0,
        max_stream_len: int = 100_000,
        max_in_flight: int = 16,
        deployment: str = DEFAULT_DEPLOYMENT,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.redis_url = redis_url
        self.config = config
        self.hidden_size = hidden_size
        self.target_rms = target_rms
        self.fingerprint = encoder_fingerprint(config, hidden_size, target_rms)
        self.deployment = deployment
        self.stream = jobs_stream(deployment)  # checks the name
        self._vlm = config.family is not None  # its entries must carry a layout
        self.timeout_s = timeout_s
        self.max_stream_len = max_stream_len
        # this replica's jobs in the stream at once; more wait here, let in round-robin by key
        self._gate = FairGate(max_in_flight)
        self._image_ttl_ms = max(1, int(image_ttl_s * 1000))
        self._vision_ttl_s = vision_ttl_s
        self._client: Redis | RedisCluster | None = None
        self._republish: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self.jobs = 0  # jobs enqueued by this encoder

    async def start(self) -> None:
        """Check Redis, create the job stream's consumer group and publish this gateway's
        encoder spec as its deployment's current one; raises if Redis is down."""
        from encoder_worker.worker import ensure_group

        if self._client is not None:
            return
        client = async_client(
            self.redis_url,
            socket_connect_timeout=2.0,
            socket_timeout=_SOCKET_TIMEOUT_S,
            decode_responses=False,
        )
        try:
            await client.ping()
            await ensure_group(client, self.stream)
            await self._publish(client)
            workers = await live_workers(client, self.deployment, self.fingerprint)
        except BaseException:
            await client.aclose()
            raise
        if workers == 0:
            log.warning(
                "encoder.no_workers_yet",
                stream=self.stream,
                deployment=self.deployment,
                hint=f"start `visiongate worker --redis-url ...{self._deployment_flag}` "
                "processes; they take this gateway's encoder configuration from Redis",
            )
        self._client = client
        self._republish = asyncio.create_task(self._keep_published(), name="publish encoder spec")
        log.info(
            "encoder.remote_ready",
            fingerprint=self.fingerprint[:16],
            deployment=self.deployment,
            workers=workers,
        )

    @property
    def _deployment_flag(self) -> str:
        return "" if self.deployment == DEFAULT_DEPLOYMENT else f" --deployment {self.deployment}"

    def spec(self) -> EncoderSpec:
        return make_spec(
            self.config, self.hidden_size, self.target_rms, self.fingerprint, time.time()
        )

    async def _publish(self, client: Redis | RedisCluster) -> None:
        """Publish the spec and make it the deployment's current one; say so loudly when that
        replaces another gateway's, since the deployment's workers switch to this one."""
        spec = self.spec()
        await client.set(spec_key(self.fingerprint), encode_spec(spec))
        previous = await client.set(current_spec_key(self.deployment), self.fingerprint, get=True)
        previous = previous.decode() if isinstance(previous, bytes) else previous
        if previous is None or previous == self.fingerprint:
            return
        changed: dict[str, dict[str, object]] = {}
        raw, old = await client.get(spec_key(previous)), None
        with contextlib.suppress(ValueError):
            old = decode_spec(raw) if raw else None
        if old is not None:  # what differs, named as the settings are
            pairs = [(n, getattr(old, n), getattr(spec, n)) for n in ("hidden_size", "target_rms")]
            pairs += [
                (n, getattr(old.encoder, n), getattr(spec.encoder, n))
                for n in type(spec.encoder).__struct_fields__
            ]
            changed = {n: {"was": a, "now": b} for n, a, b in pairs if a != b}
        log.warning(
            "encoder.deployment_config_replaced",
            deployment=self.deployment,
            previous=previous[:16],
            fingerprint=self.fingerprint[:16],
            changed=changed,
            workers_switching=await live_workers(client, self.deployment, previous),
            hint="the deployment's workers now switch to this gateway's encoder; gateways still "
            "running the previous settings get `busy` for their images",
        )

    async def _keep_published(self) -> None:
        """Put the spec and the deployment's pointer back if Redis lost them (a restart, a
        flush); a pointer another gateway has set since is left alone."""
        assert self._client is not None
        while not self._closing.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), _REPUBLISH_S)
                return
            try:
                await self._client.set(
                    spec_key(self.fingerprint), encode_spec(self.spec()), nx=True
                )
                await self._client.set(current_spec_key(self.deployment), self.fingerprint, nx=True)
            except Exception as exc:  # Redis down: /readyz says so; retried next round
                log.debug("encoder.publish_failed", error=repr(exc))

    async def queue_depth(self) -> int:
        """Jobs in the stream not yet taken and acked by a worker."""
        if self._client is None:
            return 0
        try:
            return int(await self._client.xlen(self.stream))
        except Exception:
            return 0

    async def encode(
        self, data: bytes, *, traceparent: str | None = None, owner: str | None = None
    ) -> EncodedImage:
        """Queue the image for a worker and wait for its tokens; raises ImageError or
        GatewayError. `owner` (the API key's owner id) is not sent: the job stream is one FIFO
        that every worker reads, so fairness is decided here, where jobs enter it (at most
        `max_in_flight` of this replica's at a time, the next taken in turn by owner)."""
        from gateway.caching import sha256_hex
        from gateway.protocol.errors import GatewayError

        if self._client is None:
            raise RuntimeError("RedisEncoder is not started (await start() first)")
        if len(data) > self.config.max_image_bytes:
            raise ImageError(
                "image_too_large",
                f"image is {len(data)} bytes; the limit is {self.config.max_image_bytes}",
            )
        digest = await sha256_hex(data)
        job = EncodeJob(
            uuid.uuid4().hex,
            digest,
            self.fingerprint,
            self.hidden_size,
            self.target_rms,
            traceparent,
            time.time_ns(),
        )
        client = self._client
        try:
            # the stream is first in, first out for every worker: this replica's jobs enter it
            # a few at a time, in turn by key
            async with self._gate.hold(owner):
                key = image_key(digest)
                # usually the gateway's image store has just written the bytes: refresh it
                if not await client.pexpire(key, self._image_ttl_ms):
                    await client.set(key, bytes(data), px=self._image_ttl_ms)
                # a full queue answers busy; trimming the stream would drop waiting jobs
                if await client.xlen(self.stream) >= self.max_stream_len:
                    raise GatewayError(
                        "busy",
                        f"the encoder queue holds {self.max_stream_len} jobs; retry shortly",
                    )
                await client.xadd(self.stream, {"job": encode_job(job)})
                self.jobs += 1
                reply = await self._wait(client, result_key(job.job_id))
        except REDIS_FAILURES as exc:
            log.warning("encoder.queue_unavailable", job_id=job.job_id, error=repr(exc))
            raise GatewayError("busy", "the encoder queue is unavailable; retry shortly") from None
        if reply is None:
            log.warning(
                "encoder.timeout", job_id=job.job_id, digest=digest[:12], timeout_s=self.timeout_s
            )
            raise GatewayError(
                "busy", f"no encoder worker finished the image within {self.timeout_s:g} s"
            )
        result = decode_result(reply[1])
        if not isinstance(result, EncodeDone):
            if result.code in IMAGE_ERROR_CODES:
                raise ImageError(result.code, result.message)
            if result.code == ENCODER_MISMATCH:
                log.warning(
                    "encoder.no_worker_for_this_config",
                    job_id=job.job_id,
                    fingerprint=self.fingerprint[:16],
                    deployment=self.deployment,
                    reason=result.message,
                )
                raise GatewayError(
                    "busy",
                    "no encoder worker serves this gateway's encoder configuration: "
                    f"{result.message}",
                )
            log.error(
                "encoder.job_failed", job_id=job.job_id, digest=digest[:12], reason=result.message
            )
            raise GatewayError(
                "internal_error", f"the image could not be encoded: {result.message}"
            )
        return await self._tokens(digest, job.job_id)

    async def _wait(self, client: Redis | RedisCluster, key: str) -> list[bytes] | None:
        """BLPOP `key` for up to `timeout_s`, in slices of at most `_WAIT_SLICE_S` (a notice
        pushed between two slices stays in the list for the next); None when none came."""
        deadline = time.monotonic() + self.timeout_s
        while (left := deadline - time.monotonic()) > 0:
            # BLPOP's timeout 0 means forever: never send less than a millisecond
            reply = await client.blpop(
                [key], timeout=max(round(min(left, _WAIT_SLICE_S), 3), 0.001)
            )
            if reply is not None:
                return reply
        return None

    async def _tokens(self, digest: str, job_id: str) -> EncodedImage:
        from gateway.protocol.errors import GatewayError

        assert self._client is not None
        key = vision_key(self.fingerprint, digest)
        try:  # one key, read here: a failure elsewhere in Redis is no reason to miss it
            raw = await self._client.getex(key, px=int(self._vision_ttl_s * 1000))
        except REDIS_FAILURES as exc:  # Redis failed after the job was done: a retry hits
            log.warning("encoder.tokens_unavailable", job_id=job_id, error=repr(exc))
            raise GatewayError("busy", "the vision cache is unavailable; retry shortly") from None
        if raw is None:
            raise GatewayError(
                "internal_error",
                f"encode job {job_id} finished but its tokens are not in the vision cache "
                "(evicted at once: the cache's memory limit is too small for its traffic)",
            )
        try:
            image = unpack_encoded(read_redis_value(raw))
        except ValueError as exc:
            raise GatewayError("internal_error", f"corrupt vision-cache entry: {exc}") from None
        if image.fingerprint != self.fingerprint or image.digest != digest:
            raise GatewayError(
                "internal_error", "vision-cache entry belongs to another image or encoder"
            )
        if self._vlm and image.layout is None:
            raise GatewayError(
                "internal_error", "vision-cache entry of a VLM checkpoint has no layout"
            )
        return image

    async def aclose(self) -> None:
        if self._republish is not None:  # the flag ends it even if a Redis call absorbs the cancel
            self._closing.set()
            self._republish.cancel()
            await asyncio.wait([self._republish], timeout=10)
            self._republish = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None
