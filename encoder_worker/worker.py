"""`EncoderWorker`: one encoder worker process's loop over the Redis Streams job queue.

Each turn of the loop takes a batch of jobs (stale jobs of dead workers first, then new ones),
loads their bytes from the image store, runs `EncoderPipeline.encode_batch` on a worker thread,
and commits the batch in three steps, each awaited before the next: the outcomes (tokens into
the vision cache, dead letters), then a result notice per caller, then XACK + XDEL on the job
stream. A job is acknowledged only after its outcome and notice are stored, so a worker that
dies at any point before loses nothing: its jobs stay pending and another worker reclaims them
(XAUTOCLAIM) once idle for `claim_idle_ms`. Every command names keys of one hash slot, so the
same code runs on one Redis and on a Redis Cluster (`batch_commit.BatchCommit` writes the
batch and says why the order is safe).

How a job can end:

    encoded                 tokens in vg:vision:{fingerprint}:{digest}; caller told `done`
    ImageError              the image is bad: caller told its code at once; not retried
    unexpected error        re-enqueued with attempt + 1; after `max_attempts` failed runs
                            (crashes, or deliveries to workers that died) -> dead letter
    refused                 image bytes gone or not matching the digest, malformed job
                            -> dead letter
    other encoder           the job's fingerprint is not the one this worker serves -> dead
                            letter, caller told `encoder_mismatch` (the gateway answers `busy`)

A dead letter goes to `vg:encode:dead` with its reason, and the caller (if known) is told
`failed` with the same reason. The worker itself keeps serving.

It does not decide what to encode (the gateway does), and it serves one encoder fingerprint at a
time, that of its deployment's gateways. Every `HEARTBEAT_S` it records itself as serving that
fingerprint (gateways count live workers for `/readyz`) and reads the deployment's current
fingerprint; a worker given `build` follows it: when the gateways publish another encoder
(restarted with other settings), it builds that one between batches and serves it from then on,
and a job for an encoder other than its own makes it look at once. A job for an encoder that is
still not the worker's is refused, not re-routed. `build` raising `ConfigConflict` (the worker's
explicit flags disagree with the new configuration) ends `run_until` with that error. The
heartbeat and the switch of encoder: `deployment_follower.py`. Keys and stored values:
`storage.py`; the process around it (flags, signals): `process.py`.

What writes a batch (`batch_commit.py`), which encoder is served (`deployment_follower.py`) and
the spans of an encode (`spans.py`) live apart; what stays here is the one loop itself:
reading and reclaiming jobs, deciding each job's outcome (refused, encoded, rejected, retried,
dead) and counting it, which read best side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import structlog
from opentelemetry import trace

from encoder_worker.batch_commit import BatchCommit, StreamEntry, keep_claimed
from encoder_worker.deployment_follower import ConfigConflict, DeploymentFollower
from encoder_worker.jobs import ENCODER_MISMATCH, EncodeFailed, EncodeJob, EncoderSpec
from encoder_worker.redis_conn import REDIS_FAILURES, async_client
from encoder_worker.spans import trace_encoded
from encoder_worker.storage import (
    DEFAULT_DEPLOYMENT,
    GROUP,
    HEARTBEAT_S,
    JOBS_STREAM,
    image_key,
    jobs_stream,
)
from encoder_worker.types import ENCODE_STAGES, EncodedImage, ImageError

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer
    from redis.asyncio import Redis, RedisCluster

    from encoder_worker.pipeline import EncoderPipeline

__all__ = ("EncodeMetrics", "EncoderWorker", "ensure_group")

log = structlog.get_logger("encoder_worker.worker")


class EncodeMetrics(Protocol):
    """Where the worker records each encoded image (the gateway's `GatewayMetrics` is one)."""

    def record_encode(
        self,
        *,
        timings_ms: Mapping[str, float],
        batch_size: int,
        queue_ms: float,
        tokens_kept: int,
        tokens_total: int,
    ) -> None: ...


class _CorruptBytes(Exception):
    """The stored bytes do not hash to the job's digest: re-running cannot help."""


_Outcome = EncodedImage | ImageError | Exception


async def ensure_group(client: Redis | RedisCluster, stream: str = JOBS_STREAM) -> None:
    """Create the job stream and its consumer group if missing (idempotent)."""
    from redis.exceptions import ResponseError

    try:
        await client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class EncoderWorker:
    """Consumes its deployment's job stream (`vg:encode:jobs` for the default one) as consumer
    `consumer` of group `encoders`.

    `run_once()` handles at most one batch (returns how many jobs it took, 0 when the read timed
    out); `run_until(stop)` loops until `stop` is set, finishing the batch in hand. The pipeline
    is passed in, built by the caller (the process builds one from the gateway's published spec;
    tests share one); `build` (spec -> warmed-up pipeline, run on the worker thread), when given,
    makes the worker follow the deployment's spec as it changes.

    Each encoded job's spans go to `tracer` (default: the process's global tracer provider) and
    its measurements to `metrics` (default: none recorded).
    """

    def __init__(
        self,
        redis_url: str,
        pipeline: EncoderPipeline,
        *,
        consumer: str | None = None,
        max_batch: int | None = None,
        block_ms: int = 1000,
        claim_idle_ms: int = 30_000,
        max_attempts: int = 3,
        vision_ttl_s: float = 86400.0,
        result_ttl_s: int = 300,
        tracer: Tracer | None = None,
        metrics: EncodeMetrics | None = None,
        deployment: str = DEFAULT_DEPLOYMENT,
        build: Callable[[EncoderSpec], EncoderPipeline] | None = None,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        if claim_idle_ms < 1 or max_attempts < 1 or block_ms < 1:
            raise ValueError("claim_idle_ms, max_attempts and block_ms must be >= 1")
        self.redis_url = redis_url
        self.deployment = deployment
        self.stream = jobs_stream(deployment)
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        # the encoder served (pipeline, fingerprint), its heartbeat, and following the gateways
        self.follower = DeploymentFollower(
            pipeline,
            consumer=self.consumer,
            deployment=deployment,
            build=build,
            heartbeat_s=heartbeat_s,
        )
        self.max_batch = max_batch or pipeline.config.max_batch
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.max_attempts = max_attempts
        self.vision_ttl_ms = max(1, int(vision_ttl_s * 1000))
        self.result_ttl_s = result_ttl_s
        self.tracer = tracer if tracer is not None else trace.get_tracer("encoder_worker")
        self.metrics = metrics
        self.client: Redis | RedisCluster | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._claim_cursor: bytes | str = "0-0"
        self._next_claim = 0.0
        # counters (logs and tests)
        self.encoded = 0
        self.failed = 0  # ImageError results
        self.requeued = 0
        self.dead_lettered = 0
        self.reclaimed = 0

    @property
    def pipeline(self) -> EncoderPipeline:
        """The pipeline this worker encodes with now (another after a switch of encoder)."""
        return self.follower.pipeline

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the encoder this worker serves now."""
        return self.follower.fingerprint

    @property
    def reconfigured(self) -> int:
        """How many times this worker has switched to its deployment's new encoder."""
        return self.follower.reconfigured

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self.client is not None:
            return
        # a blocking XREADGROUP must not trip the socket timeout (on a cluster a timeout would
        # also make the client rediscover the cluster and send the read again)
        self.client = async_client(
            self.redis_url,
            socket_connect_timeout=2.0,
            socket_timeout=self.block_ms / 1000 + 10.0,
            decode_responses=False,
        )
        await self.client.ping()
        await ensure_group(self.client, self.stream)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="vg-worker-encode")
        await self.follower.start(self.client, self._executor)
        log.info(
            "worker.started",
            consumer=self.consumer,
            deployment=self.deployment,
            stream=self.stream,
            fingerprint=self.fingerprint[:16],
            hidden_size=self.pipeline.hidden_size,
            target_rms=self.pipeline.target_rms,
            max_batch=self.max_batch,
            claim_idle_ms=self.claim_idle_ms,
            max_attempts=self.max_attempts,
        )

    async def aclose(self) -> None:
        """Stop the heartbeat and leave the workers' set; leave the group if nothing is pending
        to this consumer; release the thread."""
        await self.follower.aclose()
        if self.client is not None:
            with contextlib.suppress(Exception):
                pending = await self.client.xpending_range(
                    self.stream, GROUP, "-", "+", 1, consumername=self.consumer
                )
                if not pending:
                    await self.client.xgroup_delconsumer(self.stream, GROUP, self.consumer)
            await self.client.aclose()
            self.client = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        log.info(
            "worker.stopped",
            consumer=self.consumer,
            encoded=self.encoded,
            failed=self.failed,
            requeued=self.requeued,
            dead_lettered=self.dead_lettered,
            reclaimed=self.reclaimed,
            reconfigured=self.reconfigured,
        )

    async def run_until(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set. A read blocks at most `block_ms`, so stopping takes at
        most that plus the batch in hand; jobs read are always finished (or left pending).
        Raises `ConfigConflict` when the deployment moves to an encoder this worker cannot
        serve."""
        await self.start()
        backoff = 0.5
        while not stop.is_set():
            try:
                if self.follower.wanted is not None:
                    await self.follower.follow(self.follower.wanted)
                await self.run_once()
                backoff = 0.5
                continue
            except ConfigConflict:
                raise
            except REDIS_FAILURES as exc:  # Redis restarting, a node failing over: keep trying
                log.warning("worker.redis_error", error=repr(exc), retry_in_s=backoff)
            except Exception:
                # a bug must not end the worker: the batch stays pending, is reclaimed after
                # claim_idle_ms and counts as an attempt, so a job that triggers it ends dead
                log.exception("worker.batch_failed", retry_in_s=backoff)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff)
            backoff = min(backoff * 2, 10.0)

    async def run_once(self) -> int:
        """Handle one batch: reclaimed stale jobs if any are due, else newly read ones."""
        from redis.exceptions import ResponseError

        if self.client is None:
            await self.start()
        try:
            entries = await self._claim_stale()
            if not entries:
                entries = await self._read()
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("worker.group_recreated", stream=self.stream, group=GROUP)
            await ensure_group(self.client, self.stream)  # deleted (FLUSHALL, a new Redis)
            self._claim_cursor = "0-0"
            return 0
        if not entries:
            return 0
        await self._handle(entries)
        return len(entries)

    # -- reading -----------------------------------------------------------------------------

    async def _read(self) -> list[StreamEntry]:
        assert self.client is not None
        reply = await self.client.xreadgroup(
            GROUP, self.consumer, {self.stream: ">"}, count=self.max_batch, block=self.block_ms
        )
        if not reply:
            return []
        messages = reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
        return [StreamEntry.read(entry_id, fields, 1) for entry_id, fields in messages]

    async def _claim_stale(self) -> list[StreamEntry]:
        """Jobs pending longer than `claim_idle_ms` (their worker died or stalled), now ours."""
        assert self.client is not None
        now = time.monotonic()
        if now < self._next_claim:
            return []
        cursor, messages, *_ = await self.client.xautoclaim(
            self.stream,
            GROUP,
            self.consumer,
            self.claim_idle_ms,
            start_id=self._claim_cursor,
            count=self.max_batch,
        )
        self._claim_cursor = cursor
        if cursor in (b"0-0", "0-0"):  # the scan went round: look again in a while
            self._next_claim = now + min(self.claim_idle_ms / 2000, 5.0)
        entries = []
        for entry_id, fields in messages:
            if fields is None:  # the entry itself is gone: nothing to run, stop tracking it
                await self.client.xack(self.stream, GROUP, entry_id)
                continue
            pending = await self.client.xpending_range(self.stream, GROUP, entry_id, entry_id, 1)
            deliveries = int(pending[0]["times_delivered"]) if pending else 2
            entries.append(StreamEntry.read(entry_id, fields, deliveries))
        if entries:
            self.reclaimed += len(entries)
            log.warning(
                "worker.reclaimed",
                consumer=self.consumer,
                jobs=len(entries),
                entry_ids=[e.entry_id.decode() for e in entries],
            )
        return entries

    # -- one batch ---------------------------------------------------------------------------

    async def _handle(self, entries: list[StreamEntry]) -> None:
        assert self.client is not None
        if self.follower.follows and any(
            e.job is not None and e.job.fingerprint != self.fingerprint for e in entries
        ):  # a gateway may have published another encoder since the last heartbeat
            async with keep_claimed(
                self.client, self.stream, self.consumer, entries, self.claim_idle_ms
            ):
                await self.follower.follow()
        commit = BatchCommit(
            self.client, self.stream, self.consumer, self.vision_ttl_ms, self.result_ttl_s
        )
        runnable: list[StreamEntry] = []
        for entry in entries:
            refusal = self._refusal(entry)
            if refusal is not None:
                self._dead(commit, entry, *refusal)
            else:
                runnable.append(entry)
        if runnable:
            # one GET per key, not MGET: the images' keys lie in different hash slots
            reads = self.client.pipeline(transaction=False)
            for entry in runnable:
                reads.get(image_key(entry.job.digest))  # type: ignore[union-attr]
            datas = await reads.execute()
            kept = []
            for entry, data in zip(runnable, datas, strict=True):
                if data is None:
                    self._dead(
                        commit,
                        entry,
                        f"image bytes gone: no {image_key(entry.job.digest)} "  # type: ignore[union-attr]
                        "(expired or evicted before the job ran)",
                    )
                else:
                    entry.data = data
                    kept.append(entry)
            runnable = kept
        started_ns = time.time_ns()
        outcomes: list[_Outcome] = []
        if runnable:
            loop = asyncio.get_running_loop()
            async with keep_claimed(
                self.client, self.stream, self.consumer, runnable, self.claim_idle_ms
            ):
                outcomes = await loop.run_in_executor(self._executor, self._encode, runnable)
        encoded: list[tuple[StreamEntry, EncodedImage]] = []
        for entry, outcome in zip(runnable, outcomes, strict=True):
            job = entry.job
            assert job is not None
            if isinstance(outcome, EncodedImage):
                commit.store(entry, outcome)
                encoded.append((entry, outcome))
            elif isinstance(outcome, ImageError):
                commit.notify(job.job_id, EncodeFailed(job.job_id, outcome.code, outcome.message))
                commit.ack(entry)
                self.failed += 1
                log.info(
                    "worker.image_rejected",
                    job_id=job.job_id,
                    digest=job.digest[:12],
                    code=outcome.code,
                    error=outcome.message,
                )
            elif isinstance(outcome, _CorruptBytes):
                self._dead(commit, entry, str(outcome))
            else:
                self._crashed(commit, entry, outcome)
        t_put = time.perf_counter()
        await commit.execute()
        put_ms = (time.perf_counter() - t_put) * 1e3
        self.encoded += len(encoded)
        if encoded:
            log.info(
                "worker.batch",
                consumer=self.consumer,
                jobs=len(entries),
                encoded=len(encoded),
                encode_ms=round((time.time_ns() - started_ns) / 1e6 - put_ms, 2),
                put_ms=round(put_ms, 2),
            )
        for entry, image in encoded:
            self._observe(entry.job, image, started_ns, put_ms)  # type: ignore[arg-type]

    def _refusal(self, entry: StreamEntry) -> tuple[str, str] | None:
        """Why this worker will not run the job (reason, and the code its caller is told), or
        None."""
        job = entry.job
        if job is None:
            return f"malformed job: {entry.raw[:64]!r} is not an EncodeJob", "dead_letter"
        earlier = job.attempt + entry.deliveries - 1  # runs that ended without an ack
        if earlier >= self.max_attempts:
            return (
                f"gave up after {earlier} attempts (max_attempts={self.max_attempts}): the "
                f"workers running it died or stalled past claim_idle_ms={self.claim_idle_ms}"
            ), "dead_letter"
        mismatch = self.follower.mismatch(job)
        return None if mismatch is None else (mismatch, ENCODER_MISMATCH)

    def _dead(
        self, commit: BatchCommit, entry: StreamEntry, reason: str, code: str = "dead_letter"
    ) -> None:
        attempts = (entry.job.attempt if entry.job else 0) + entry.deliveries
        commit.dead(entry, reason, attempts, code)
        self.dead_lettered += 1
        log.error(
            "worker.dead_letter",
            job_id=entry.job.job_id if entry.job else None,
            entry_id=entry.entry_id.decode(),
            reason=reason,
            attempts=attempts,
        )

    def _crashed(self, commit: BatchCommit, entry: StreamEntry, exc: Exception) -> None:
        job = entry.job
        assert job is not None
        failures = job.attempt + entry.deliveries  # this run included
        if failures >= self.max_attempts:
            self._dead(
                commit,
                entry,
                f"encoding failed {failures} times (max_attempts="
                f"{self.max_attempts}); last error: {type(exc).__name__}: {exc}",
            )
            return
        commit.requeue(entry)
        self.requeued += 1
        log.warning(
            "worker.job_failed_requeued",
            job_id=job.job_id,
            digest=job.digest[:12],
            attempt=failures,
            max_attempts=self.max_attempts,
            error=f"{type(exc).__name__}: {exc}",
        )

    def _encode(self, entries: list[StreamEntry]) -> list[_Outcome]:
        """On the worker thread: check the bytes against their digests, encode the batch; if the
        batch call itself fails, run the images one by one so only the culprit fails."""
        outcomes: list[_Outcome | None] = [None] * len(entries)
        todo: list[int] = []
        for i, entry in enumerate(entries):
            assert entry.data is not None and entry.job is not None
            if hashlib.sha256(entry.data).hexdigest() != entry.job.digest:
                key = image_key(entry.job.digest)
                outcomes[i] = _CorruptBytes(
                    f"image bytes corrupt: {key} does not hash to its digest"
                )
            else:
                todo.append(i)
        done = self._encode_datas([entries[i].data for i in todo])  # type: ignore[misc]
        for i, outcome in zip(todo, done, strict=True):
            outcomes[i] = outcome
        return outcomes  # type: ignore[return-value]

    def _encode_datas(self, datas: list[bytes]) -> list[_Outcome]:
        if not datas:
            return []
        try:
            return list(self.pipeline.encode_batch(datas))
        except Exception as exc:
            if len(datas) == 1:
                log.exception("worker.encode_failed", batch_size=1)
                return [exc]
        log.warning("worker.batch_failed_retrying_singly", batch_size=len(datas))
        return [self._encode_datas([d])[0] for d in datas]

    # -- telemetry ---------------------------------------------------------------------------

    def _observe(self, job: EncodeJob, image: EncodedImage, started_ns: int, put_ms: float) -> None:
        """Stage spans under the caller's span (or a worker root span) and encode metrics."""
        timings = image.timings_ms
        stages = {k: float(timings[k]) for k in ENCODE_STAGES if k in timings}
        batch_size = int(timings.get("batch_size", 1))
        queue_ms = max((started_ns - job.enqueued_ns) / 1e6, 0.0)
        trace_encoded(self.tracer, job, image, started_ns, stages, put_ms, batch_size, queue_ms)
        if self.metrics is not None:
            self.metrics.record_encode(
                timings_ms=stages,
                batch_size=batch_size,
                queue_ms=queue_ms,
                tokens_kept=image.tokens_kept,
                tokens_total=image.tokens_total,
            )
