"""`EncoderWorker`: one encoder worker process's loop over the Redis Streams job queue.

Each turn of the loop takes a batch of jobs (stale jobs of dead workers first, then new ones),
loads their bytes from the image store, runs `EncoderPipeline.encode_batch` on a worker thread,
and commits the whole batch in one MULTI/EXEC: the tokens into the vision cache, a result
notice per caller, XACK + XDEL. A job is acknowledged only in the transaction that stores its
outcome, so a worker that dies at any point before it loses nothing: its jobs stay pending
and another worker reclaims them (XAUTOCLAIM) once idle for `claim_idle_ms`.

How a job can end:

    encoded                 tokens in vg:vision:{fingerprint}:{digest}; caller told `done`
    ImageError              the image is bad: caller told its code at once; not retried
    unexpected error        re-enqueued with attempt + 1; after `max_attempts` failed runs
                            (crashes, or deliveries to workers that died) -> dead letter
    refused                 fingerprint / hidden size / target RMS not this worker's, image bytes
                            gone or not matching the digest, malformed job -> dead letter

A dead letter goes to `vg:encode:dead` with its reason, and the caller (if known) is told
`failed` with the same reason. The worker itself keeps serving.

It does not decide what to encode (the gateway does), and it serves one encoder fingerprint:
jobs for another are refused, not re-routed. Keys and stored values: `storage.py`; the process
around it (flags, signals): `process.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec
import structlog
from opentelemetry import trace

from encoder_worker.jobs import (
    EncodeDone,
    EncodeFailed,
    EncodeJob,
    decode_job,
    encode_job,
    encode_result,
)
from encoder_worker.spans import (
    ENCODE_ATTR,
    ENCODE_SPAN,
    has_parent,
    lay_spans,
    parent_context,
    stage_span_name,
)
from encoder_worker.storage import (
    DEAD_STREAM,
    GROUP,
    JOBS_STREAM,
    image_key,
    pack_encoded,
    redis_value,
    result_key,
    vision_key,
)
from encoder_worker.types import ENCODE_STAGES, EncodedImage, ImageError

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer
    from redis.asyncio import Redis

    from encoder_worker.pipeline import EncoderPipeline

__all__ = ("EncodeMetrics", "EncoderWorker", "ensure_group")

log = structlog.get_logger("encoder_worker.worker")

_DEAD_MAXLEN = 10_000


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


async def ensure_group(client: Redis) -> None:
    """Create the job stream and its consumer group if missing (idempotent)."""
    from redis.exceptions import ResponseError

    try:
        await client.xgroup_create(JOBS_STREAM, GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


@dataclass(slots=True)
class _Entry:
    entry_id: bytes
    job: EncodeJob | None  # None: malformed
    raw: bytes  # the job field as stored (dead letters keep it verbatim)
    deliveries: int  # times the stream has handed this entry out, this time included
    data: bytes | None = None


class _Commit:
    """Everything one batch writes, sent as one MULTI/EXEC."""

    __slots__ = ("_pipe", "_result_ttl_s", "_vision_ttl_ms", "acked", "consumer")

    def __init__(self, client: Redis, consumer: str, vision_ttl_ms: int, result_ttl_s: int) -> None:
        self._pipe = client.pipeline(transaction=True)
        self._vision_ttl_ms = vision_ttl_ms
        self._result_ttl_s = result_ttl_s
        self.consumer = consumer
        self.acked = 0

    def notify(self, job_id: str, result: EncodeDone | EncodeFailed) -> None:
        key = result_key(job_id)
        self._pipe.rpush(key, encode_result(result))
        self._pipe.expire(key, self._result_ttl_s)

    def ack(self, entry: _Entry) -> None:
        self._pipe.xack(JOBS_STREAM, GROUP, entry.entry_id)
        self._pipe.xdel(JOBS_STREAM, entry.entry_id)  # the stream holds only outstanding jobs
        self.acked += 1

    def store(self, entry: _Entry, image: EncodedImage) -> None:
        assert entry.job is not None
        # the value and key the gateway's vision cache reads (storage.py)
        value = redis_value(pack_encoded(image))
        self._pipe.set(
            vision_key(entry.job.fingerprint, entry.job.digest), value, px=self._vision_ttl_ms
        )
        self.notify(
            entry.job.job_id, EncodeDone(entry.job.job_id, self.consumer, image.tokens_kept)
        )
        self.ack(entry)

    def requeue(self, entry: _Entry) -> None:
        assert entry.job is not None
        # every delivery of this entry was a run (those lost with dead workers included)
        job = msgspec.structs.replace(entry.job, attempt=entry.job.attempt + entry.deliveries)
        self._pipe.xadd(JOBS_STREAM, {"job": encode_job(job)})
        self.ack(entry)

    def dead(self, entry: _Entry, reason: str, attempts: int) -> None:
        self._pipe.xadd(
            DEAD_STREAM,
            {"job": entry.raw, "reason": reason, "consumer": self.consumer, "attempts": attempts},
            maxlen=_DEAD_MAXLEN,
            approximate=True,
        )
        if entry.job is not None:
            self.notify(entry.job.job_id, EncodeFailed(entry.job.job_id, "dead_letter", reason))
        self.ack(entry)

    async def execute(self) -> None:
        if len(self._pipe):
            await self._pipe.execute()


class EncoderWorker:
    """Consumes `vg:encode:jobs` as consumer `consumer` of group `encoders`.

    `run_once()` handles at most one batch (returns how many jobs it took, 0 when the read timed
    out); `run_until(stop)` loops until `stop` is set, finishing the batch in hand. The pipeline
    is passed in, built by the caller (the CLI builds one from its flags; tests share one).

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
    ) -> None:
        if claim_idle_ms < 1 or max_attempts < 1 or block_ms < 1:
            raise ValueError("claim_idle_ms, max_attempts and block_ms must be >= 1")
        self.redis_url = redis_url
        self.pipeline = pipeline
        self.fingerprint = pipeline.fingerprint
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.max_batch = max_batch or pipeline.config.max_batch
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.max_attempts = max_attempts
        self.vision_ttl_ms = max(1, int(vision_ttl_s * 1000))
        self.result_ttl_s = result_ttl_s
        self.tracer = tracer if tracer is not None else trace.get_tracer("encoder_worker")
        self.metrics = metrics
        self.client: Redis | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._claim_cursor: bytes | str = "0-0"
        self._next_claim = 0.0
        # counters (logs and tests)
        self.encoded = 0
        self.failed = 0  # ImageError results
        self.requeued = 0
        self.dead_lettered = 0
        self.reclaimed = 0

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        from redis.asyncio import Redis

        if self.client is not None:
            return
        # a blocking XREADGROUP must not trip the socket timeout
        self.client = Redis.from_url(
            self.redis_url,
            socket_connect_timeout=2.0,
            socket_timeout=self.block_ms / 1000 + 10.0,
            decode_responses=False,
        )
        await self.client.ping()
        await ensure_group(self.client)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="vg-worker-encode")
        log.info(
            "worker.started",
            consumer=self.consumer,
            fingerprint=self.fingerprint[:16],
            hidden_size=self.pipeline.hidden_size,
            target_rms=self.pipeline.target_rms,
            max_batch=self.max_batch,
            claim_idle_ms=self.claim_idle_ms,
            max_attempts=self.max_attempts,
        )

    async def aclose(self) -> None:
        """Leave the group if nothing is pending to this consumer; release the thread."""
        if self.client is not None:
            with contextlib.suppress(Exception):
                pending = await self.client.xpending_range(
                    JOBS_STREAM, GROUP, "-", "+", 1, consumername=self.consumer
                )
                if not pending:
                    await self.client.xgroup_delconsumer(JOBS_STREAM, GROUP, self.consumer)
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
        )

    async def run_until(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set. A read blocks at most `block_ms`, so stopping takes at
        most that plus the batch in hand; jobs read are always finished (or left pending)."""
        from redis.exceptions import RedisError

        await self.start()
        backoff = 0.5
        while not stop.is_set():
            try:
                await self.run_once()
                backoff = 0.5
                continue
            except (RedisError, OSError) as exc:  # Redis restarting: keep trying, slowly
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
            log.warning("worker.group_recreated", stream=JOBS_STREAM, group=GROUP)
            await ensure_group(self.client)  # the stream was deleted (FLUSHALL, a new Redis)
            self._claim_cursor = "0-0"
            return 0
        if not entries:
            return 0
        await self._handle(entries)
        return len(entries)

    # -- reading -----------------------------------------------------------------------------

    async def _read(self) -> list[_Entry]:
        assert self.client is not None
        reply = await self.client.xreadgroup(
            GROUP, self.consumer, {JOBS_STREAM: ">"}, count=self.max_batch, block=self.block_ms
        )
        if not reply:
            return []
        messages = reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
        return [self._entry(entry_id, fields, 1) for entry_id, fields in messages]

    async def _claim_stale(self) -> list[_Entry]:
        """Jobs pending longer than `claim_idle_ms` (their worker died or stalled), now ours."""
        assert self.client is not None
        now = time.monotonic()
        if now < self._next_claim:
            return []
        cursor, messages, *_ = await self.client.xautoclaim(
            JOBS_STREAM,
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
                await self.client.xack(JOBS_STREAM, GROUP, entry_id)
                continue
            pending = await self.client.xpending_range(JOBS_STREAM, GROUP, entry_id, entry_id, 1)
            deliveries = int(pending[0]["times_delivered"]) if pending else 2
            entries.append(self._entry(entry_id, fields, deliveries))
        if entries:
            self.reclaimed += len(entries)
            log.warning(
                "worker.reclaimed",
                consumer=self.consumer,
                jobs=len(entries),
                entry_ids=[e.entry_id.decode() for e in entries],
            )
        return entries

    async def _keep_claimed(self, entry_ids: list[bytes]) -> None:
        """While a long batch encodes, keep resetting its jobs' idle time (XCLAIM JUSTID does
        not count a delivery), so other workers do not take them over as stalled."""
        assert self.client is not None
        while True:
            await asyncio.sleep(max(self.claim_idle_ms / 3000, 0.05))
            try:
                await self.client.xclaim(
                    JOBS_STREAM, GROUP, self.consumer, 0, entry_ids, justid=True
                )
            except Exception as exc:  # a missed heartbeat costs at most a duplicate encode
                log.warning("worker.heartbeat_failed", error=str(exc))

    @staticmethod
    def _entry(entry_id: bytes, fields: dict[bytes, bytes], deliveries: int) -> _Entry:
        raw = fields.get(b"job", b"")
        try:
            job: EncodeJob | None = decode_job(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            job = None
        return _Entry(entry_id, job, raw, deliveries)

    # -- one batch ---------------------------------------------------------------------------

    async def _handle(self, entries: list[_Entry]) -> None:
        assert self.client is not None
        commit = _Commit(self.client, self.consumer, self.vision_ttl_ms, self.result_ttl_s)
        runnable: list[_Entry] = []
        for entry in entries:
            reason = self._refusal(entry)
            if reason is not None:
                self._dead(commit, entry, reason)
            else:
                runnable.append(entry)
        if runnable:
            datas = await self.client.mget([image_key(e.job.digest) for e in runnable])  # type: ignore[union-attr]
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
            heartbeat = asyncio.create_task(self._keep_claimed([e.entry_id for e in runnable]))
            try:
                outcomes = await loop.run_in_executor(self._executor, self._encode, runnable)
            finally:
                heartbeat.cancel()
        encoded: list[tuple[_Entry, EncodedImage]] = []
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

    def _refusal(self, entry: _Entry) -> str | None:
        """Why this worker will not run the job, or None."""
        job = entry.job
        if job is None:
            return f"malformed job: {entry.raw[:64]!r} is not an EncodeJob"
        earlier = job.attempt + entry.deliveries - 1  # runs that ended without an ack
        if earlier >= self.max_attempts:
            return (
                f"gave up after {earlier} attempts (max_attempts={self.max_attempts}): the "
                f"workers running it died or stalled past claim_idle_ms={self.claim_idle_ms}"
            )
        if job.fingerprint == self.fingerprint:
            return None
        p = self.pipeline
        head = (
            f"fingerprint mismatch: the job expects encoder {job.fingerprint[:16]}, this worker "
            f"makes {self.fingerprint[:16]}"
        )
        family = getattr(p, "family", None)
        if family is not None:  # a real checkpoint: its tokens do not depend on these flags
            return (
                f"{head}; this worker serves the {family.name} checkpoint {p.config.tower} "
                f"(pruning {p.config.pruning}, visual tokens {p.config.visual_tokens}): start "
                "workers with the gateway's --model-path, --pruning and --visual-tokens"
            )
        if job.hidden_size != p.hidden_size:
            return (
                f"{head}; hidden size: job {job.hidden_size}, worker {p.hidden_size} "
                f"(start the worker with --hidden-size {job.hidden_size})"
            )
        if job.target_rms != p.target_rms:
            return (
                f"{head}; target RMS: job {job.target_rms!r}, worker {p.target_rms!r} "
                f"(start the worker with --target-rms {job.target_rms!r})"
            )
        return (
            f"{head}; the encoder config differs (tower, feature layer, pruning, quantization "
            "or seed): start workers with the gateway's settings"
        )

    def _dead(self, commit: _Commit, entry: _Entry, reason: str) -> None:
        attempts = (entry.job.attempt if entry.job else 0) + entry.deliveries
        commit.dead(entry, reason, attempts)
        self.dead_lettered += 1
        log.error(
            "worker.dead_letter",
            job_id=entry.job.job_id if entry.job else None,
            entry_id=entry.entry_id.decode(),
            reason=reason,
            attempts=attempts,
        )

    def _crashed(self, commit: _Commit, entry: _Entry, exc: Exception) -> None:
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

    def _encode(self, entries: list[_Entry]) -> list[_Outcome]:
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
        attrs = {ENCODE_ATTR.BATCH_SIZE: batch_size, ENCODE_ATTR.IMAGE_DIGEST: job.digest[:12]}
        tracer = self.tracer
        root = None
        parent = parent_context(job.traceparent)
        if not has_parent(parent):  # none, or malformed
            root = tracer.start_span(
                ENCODE_SPAN.JOB,
                context=parent,
                start_time=min(job.enqueued_ns, started_ns),
                attributes={**attrs, ENCODE_ATTR.ATTEMPT: job.attempt},
            )
            parent = trace.set_span_in_context(root)
        if job.enqueued_ns < started_ns:
            lay_spans(tracer, parent, job.enqueued_ns, {ENCODE_SPAN.QUEUE: queue_ms}, attrs)
        cursor = lay_spans(
            tracer,
            parent,
            started_ns,
            {stage_span_name(k): ms for k, ms in stages.items()},
            {
                **attrs,
                ENCODE_ATTR.TOKENS_KEPT: image.tokens_kept,
                ENCODE_ATTR.TOKENS_TOTAL: image.tokens_total,
            },
        )
        end = lay_spans(tracer, parent, cursor, {ENCODE_SPAN.CACHE_PUT: put_ms}, attrs)
        if root is not None:
            root.end(end_time=end)
        if self.metrics is not None:
            self.metrics.record_encode(
                timings_ms=stages,
                batch_size=batch_size,
                queue_ms=queue_ms,
                tokens_kept=image.tokens_kept,
                tokens_total=image.tokens_total,
            )
