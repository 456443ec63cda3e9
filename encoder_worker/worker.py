"""`EncoderWorker`: one encoder worker process's loop over the Redis Streams job queue.

Each turn of the loop takes a batch of jobs (stale jobs of dead workers first, then new ones),
loads their bytes from the image store, runs `EncoderPipeline.encode_batch` on a worker thread,
and commits the batch in three steps, each awaited before the next: the outcomes (tokens into
the vision cache, dead letters), then a result notice per caller, then XACK + XDEL on the job
stream. A job is acknowledged only after its outcome and notice are stored, so a worker that
dies at any point before loses nothing: its jobs stay pending and another worker reclaims them
(XAUTOCLAIM) once idle for `claim_idle_ms`. Every command names keys of one hash slot, so the
same code runs on one Redis and on a Redis Cluster (`_Commit` says why the order is safe).

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
explicit flags disagree with the new configuration) ends `run_until` with that error. Keys and
stored values: `storage.py`; the process around it (flags, signals): `process.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import structlog
from opentelemetry import trace

from encoder_worker.jobs import (
    ENCODER_MISMATCH,
    EncodeDone,
    EncodeFailed,
    EncodeJob,
    EncoderSpec,
    decode_job,
    decode_spec,
    encode_job,
    encode_result,
)
from encoder_worker.redis_conn import REDIS_FAILURES, async_client
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
    DEFAULT_DEPLOYMENT,
    GROUP,
    HEARTBEAT_S,
    JOBS_STREAM,
    WORKER_LIVE_S,
    current_spec_key,
    image_key,
    jobs_stream,
    pack_encoded,
    redis_value,
    result_key,
    spec_key,
    vision_key,
    workers_key,
)
from encoder_worker.types import ENCODE_STAGES, EncodedImage, ImageError

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer
    from redis.asyncio import Redis, RedisCluster

    from encoder_worker.pipeline import EncoderPipeline

__all__ = ("ConfigConflict", "EncodeMetrics", "EncoderWorker", "ensure_group", "read_current_spec")

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


class ConfigConflict(ValueError):
    """This worker cannot serve its deployment's encoder configuration (its explicit flags
    disagree, or it cannot reproduce the gateway's encoder); the message says what differs."""


# A heartbeat, timed by the Redis server's clock (hosts' clocks may disagree): record this
# worker under its encoder and forget workers unseen for long. One key: a script on a Redis
# Cluster may only touch keys of one hash slot, so the deployment's current fingerprint (another
# key) is read by a separate GET.
_HEARTBEAT = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1000000
redis.call('ZADD', KEYS[1], t, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', t - tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[1], ARGV[3])
"""


_Outcome = EncodedImage | ImageError | Exception


async def ensure_group(client: Redis | RedisCluster, stream: str = JOBS_STREAM) -> None:
    """Create the job stream and its consumer group if missing (idempotent)."""
    from redis.exceptions import ResponseError

    try:
        await client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def read_current_spec(client: Redis | RedisCluster, deployment: str) -> EncoderSpec | None:
    """The encoder spec the deployment's gateways last published, or None if there is none
    yet; ValueError if it does not decode (another release's, or damaged)."""
    fingerprint = await client.get(current_spec_key(deployment))
    if not fingerprint:
        return None
    raw = await client.get(spec_key(fingerprint.decode()))
    return None if raw is None else decode_spec(raw)


@dataclass(slots=True)
class _Entry:
    entry_id: bytes
    job: EncodeJob | None  # None: malformed
    raw: bytes  # the job field as stored (dead letters keep it verbatim)
    deliveries: int  # times the stream has handed this entry out, this time included
    data: bytes | None = None


class _Commit:
    """Everything one batch writes, in three steps awaited in this order:

    1. outcomes: each encoded image's tokens into the vision cache (SET, one key each) and each
       dead letter (XADD to `vg:encode:dead`), in one non-transactional pipeline;
    2. notices: RPUSH + EXPIRE on each caller's result list (one key per notice);
    3. the job stream: requeued jobs XADDed again, then XACK + XDEL of the batch's entries, in
       one MULTI/EXEC: every command of it names the job stream, so it is one hash slot.

    No command, script or MULTI names keys of two hash slots, which a Redis Cluster refuses;
    what one step writes is not atomic with the next, and the order is what keeps delivery at
    least once. A job leaves the stream's pending list only in step 3, after its outcome and
    its notice are stored. A worker that dies (or a Redis call that fails) between steps leaves
    the job pending: another worker reclaims it after `claim_idle_ms` and runs it again, and
    nothing was lost. Running it again repeats what was already written, which is harmless:
    the tokens are content-addressed (the same key gets equal tokens), a dead letter may be
    recorded twice, and a second notice lands on a list whose caller has already taken the
    first: the caller BLPOPs one notice per job id (a fresh uuid per job) and stops listening,
    and the list expires after `result_ttl_s`. A requeue needs no such care: the new entry and
    the old one's ack are one MULTI, so the job is in the stream once. Acking before the
    notice, by contrast, could lose a caller's only answer if the worker died in between.
    """

    __slots__ = (
        "_acks",
        "_notices",
        "_outcomes",
        "_result_ttl_s",
        "_stream",
        "_stream_step",
        "_vision_ttl_ms",
        "acked",
        "consumer",
    )

    def __init__(
        self,
        client: Redis | RedisCluster,
        stream: str,
        consumer: str,
        vision_ttl_ms: int,
        result_ttl_s: int,
    ) -> None:
        self._outcomes = client.pipeline(transaction=False)
        self._notices = client.pipeline(transaction=False)
        self._stream_step = client.pipeline(transaction=True)  # one key: the job stream
        self._acks: list[bytes] = []
        self._stream = stream
        self._vision_ttl_ms = vision_ttl_ms
        self._result_ttl_s = result_ttl_s
        self.consumer = consumer
        self.acked = 0

    def notify(self, job_id: str, result: EncodeDone | EncodeFailed) -> None:
        key = result_key(job_id)
        self._notices.rpush(key, encode_result(result))
        self._notices.expire(key, self._result_ttl_s)

    def ack(self, entry: _Entry) -> None:
        self._acks.append(entry.entry_id)
        self.acked += 1

    def store(self, entry: _Entry, image: EncodedImage) -> None:
        assert entry.job is not None
        # the value and key the gateway's vision cache reads (storage.py)
        value = redis_value(pack_encoded(image))
        self._outcomes.set(
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
        self._stream_step.xadd(self._stream, {"job": encode_job(job)})
        self.ack(entry)

    def dead(self, entry: _Entry, reason: str, attempts: int, code: str = "dead_letter") -> None:
        self._outcomes.xadd(
            DEAD_STREAM,
            {"job": entry.raw, "reason": reason, "consumer": self.consumer, "attempts": attempts},
            maxlen=_DEAD_MAXLEN,
            approximate=True,
        )
        if entry.job is not None:
            self.notify(entry.job.job_id, EncodeFailed(entry.job.job_id, code, reason))
        self.ack(entry)

    async def execute(self) -> None:
        """Send the three steps in order; a step that fails raises before the next is sent."""
        if len(self._outcomes):
            await self._outcomes.execute()
        if len(self._notices):
            await self._notices.execute()
        if self._acks:
            self._stream_step.xack(self._stream, GROUP, *self._acks)
            # the stream holds only outstanding jobs
            self._stream_step.xdel(self._stream, *self._acks)
        if len(self._stream_step):
            await self._stream_step.execute()


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
        self.pipeline = pipeline
        self.fingerprint = pipeline.fingerprint
        self.deployment = deployment
        self.stream = jobs_stream(deployment)
        self._build = build
        self.heartbeat_s = heartbeat_s
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
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
        self._heartbeat: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()  # ends the heartbeat even if a cancel goes astray
        self._beat_script: Any = None  # the _HEARTBEAT script, registered on start
        self._beat_lock = asyncio.Lock()  # no heartbeat lands under a fingerprint just left
        self._wanted: str | None = None  # the deployment's fingerprint, when not ours
        # counters (logs and tests)
        self.encoded = 0
        self.failed = 0  # ImageError results
        self.requeued = 0
        self.dead_lettered = 0
        self.reclaimed = 0
        self.reconfigured = 0

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
        self._beat_script = self.client.register_script(_HEARTBEAT)
        await self._beat()
        self._closing.clear()
        self._heartbeat = asyncio.create_task(self._beat_forever(), name="worker heartbeat")
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
        if self._heartbeat is not None:
            # the flag, not only the cancel: a cancel that lands inside a Redis call may be
            # absorbed there, and the loop must still end
            self._closing.set()
            self._heartbeat.cancel()
            await asyncio.wait([self._heartbeat], timeout=10)
            self._heartbeat = None
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.zrem(
                    workers_key(self.deployment, self.fingerprint), self.consumer
                )
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
                if self._wanted is not None:
                    await self._follow(self._wanted)
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

    async def _read(self) -> list[_Entry]:
        assert self.client is not None
        reply = await self.client.xreadgroup(
            GROUP, self.consumer, {self.stream: ">"}, count=self.max_batch, block=self.block_ms
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

    # -- heartbeat and following the deployment's encoder --------------------------------------

    async def _beat(self) -> None:
        """Record this worker as serving its encoder; note the deployment's current one."""
        assert self.client is not None
        async with self._beat_lock:
            await self._beat_script(
                keys=[workers_key(self.deployment, self.fingerprint)],
                args=[self.consumer, WORKER_LIVE_S * 6, WORKER_LIVE_S * 6],
            )
            current = await self.client.get(current_spec_key(self.deployment))
        current = current.decode() if isinstance(current, bytes) else current
        if self._build is not None and current and current != self.fingerprint:
            self._wanted = current

    async def _beat_forever(self) -> None:
        failing = False
        while not self._closing.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self.heartbeat_s)
                return
            try:
                await self._beat()
            except Exception as exc:  # Redis restarting: the read loop reports and retries too
                if not failing:
                    log.warning("worker.heartbeat_failed", error=repr(exc))
                failing = True
            else:
                failing = False

    async def _follow(self, fingerprint: str | None = None) -> None:
        """If the deployment's gateways now encode with another fingerprint than ours (read
        from Redis unless given), build that encoder and serve it from now on."""
        assert self.client is not None
        self._wanted = None
        if self._build is None:
            return
        if fingerprint is None:
            raw = await self.client.get(current_spec_key(self.deployment))
            fingerprint = raw.decode() if raw else None
        if not fingerprint or fingerprint == self.fingerprint:
            return
        raw = await self.client.get(spec_key(fingerprint))
        if raw is None:  # a pointer without its spec: a gateway mid-publish, or damage
            log.warning(
                "worker.spec_missing", fingerprint=fingerprint[:16], key=spec_key(fingerprint)
            )
            return
        try:
            spec = decode_spec(raw)
        except ValueError as exc:
            raise ConfigConflict(
                f"the deployment's encoder spec {spec_key(fingerprint)}: {exc}"
            ) from None
        log.info(
            "worker.reconfiguring",
            consumer=self.consumer,
            deployment=self.deployment,
            serving=self.fingerprint[:16],
            wanted=fingerprint[:16],
            hidden_size=spec.hidden_size,
            target_rms=spec.target_rms,
        )
        loop = asyncio.get_running_loop()
        pipeline = await loop.run_in_executor(self._executor, self._build, spec)
        old, self.pipeline = self.pipeline, pipeline
        async with self._beat_lock:
            with contextlib.suppress(Exception):
                await self.client.zrem(
                    workers_key(self.deployment, self.fingerprint), self.consumer
                )
            self.fingerprint = pipeline.fingerprint
        self.reconfigured += 1
        await self._beat()
        close = getattr(old, "close", None)
        if close is not None:
            close()
        log.info(
            "worker.reconfigured",
            consumer=self.consumer,
            deployment=self.deployment,
            fingerprint=self.fingerprint[:16],
            hidden_size=pipeline.hidden_size,
            target_rms=pipeline.target_rms,
        )

    @contextlib.asynccontextmanager
    async def _holding(self, entries: list[_Entry]) -> AsyncIterator[None]:
        """While a long step runs (an encode, a switch of encoder), keep resetting its jobs'
        idle time (XCLAIM JUSTID does not count a delivery), so other workers do not take them
        over as stalled. Ended by a flag as well as a cancel: redis-py may absorb a cancel that
        lands inside a command, and the task must not outlive the step."""
        assert self.client is not None
        client, ids = self.client, [e.entry_id for e in entries]
        done = asyncio.Event()

        async def keep() -> None:
            while not done.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), max(self.claim_idle_ms / 3000, 0.05))
                    return
                try:
                    await client.xclaim(self.stream, GROUP, self.consumer, 0, ids, justid=True)
                except Exception as exc:  # a missed heartbeat costs at most a duplicate encode
                    log.warning("worker.heartbeat_failed", error=str(exc))

        task = asyncio.create_task(keep(), name="keep jobs claimed")
        try:
            yield
        finally:
            done.set()
            task.cancel()

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
        if self._build is not None and any(
            e.job is not None and e.job.fingerprint != self.fingerprint for e in entries
        ):  # a gateway may have published another encoder since the last heartbeat
            async with self._holding(entries):
                await self._follow()
        commit = _Commit(
            self.client, self.stream, self.consumer, self.vision_ttl_ms, self.result_ttl_s
        )
        runnable: list[_Entry] = []
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
            async with self._holding(runnable):
                outcomes = await loop.run_in_executor(self._executor, self._encode, runnable)
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

    def _refusal(self, entry: _Entry) -> tuple[str, str] | None:
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
        if job.fingerprint == self.fingerprint:
            return None
        p = self.pipeline
        head = (
            f"fingerprint mismatch: the job expects encoder {job.fingerprint[:16]}, the "
            f"workers of deployment {self.deployment!r} serve {self.fingerprint[:16]}"
        )
        family = getattr(p, "family", None)
        if family is not None:  # a real checkpoint: its tokens do not depend on these flags
            what = (
                f"the {family.name} checkpoint {p.config.tower} (pruning {p.config.pruning}, "
                f"visual tokens {p.config.visual_tokens})"
            )
        elif job.hidden_size != p.hidden_size:
            what = f"hidden size: job {job.hidden_size}, worker {p.hidden_size}"
        elif job.target_rms != p.target_rms:
            what = f"target RMS: job {job.target_rms!r}, worker {p.target_rms!r}"
        else:
            what = (
                "the encoder config differs (tower, feature layer, pruning, quantization or seed)"
            )
        why = (
            "workers take the configuration the deployment's gateways last published; the "
            "gateway that sent this job runs other settings"
            if self._build is not None
            else "this worker serves one fixed configuration"
        )
        return f"{head}; {what} ({why})", ENCODER_MISMATCH

    def _dead(self, commit: _Commit, entry: _Entry, reason: str, code: str = "dead_letter") -> None:
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
