"""How an encoder worker commits a batch of jobs: what it writes to Redis, and in which order.

A `StreamEntry` is one job as the worker read it from its deployment's job stream;
`keep_claimed` keeps a batch's jobs the worker's while it works on them (an encode, a switch of
encoder); a `BatchCommit` collects what the batch's outcomes write (tokens, dead letters,
result notices, requeues, acks) and sends it in three steps, each awaited before the next (its
docstring says why that order keeps delivery at least once, on one Redis and on a Redis Cluster
alike). The worker (`worker.py`) decides each job's outcome; this module only writes it. Keys
and stored values: `storage.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import structlog

from encoder_worker.jobs import (
    EncodeDone,
    EncodeFailed,
    EncodeJob,
    decode_job,
    encode_job,
    encode_result,
)
from encoder_worker.storage import (
    DEAD_STREAM,
    GROUP,
    pack_encoded,
    redis_value,
    result_key,
    vision_key,
)

if TYPE_CHECKING:
    from redis.asyncio import Redis, RedisCluster

    from encoder_worker.types import EncodedImage

__all__ = ("DEAD_MAXLEN", "BatchCommit", "StreamEntry", "keep_claimed")

# the worker's own events: one logger for everything a worker process says about its loop
log = structlog.get_logger("encoder_worker.worker")

DEAD_MAXLEN = 10_000  # dead letters kept (approximately) in `vg:encode:dead`


@dataclass(slots=True)
class StreamEntry:
    """One entry of the job stream, as handed to this worker."""

    entry_id: bytes
    job: EncodeJob | None  # None: malformed
    raw: bytes  # the job field as stored (dead letters keep it verbatim)
    deliveries: int  # times the stream has handed this entry out, this time included
    data: bytes | None = None  # the image bytes, once loaded from the image store

    @classmethod
    def read(cls, entry_id: bytes, fields: dict[bytes, bytes], deliveries: int) -> StreamEntry:
        """The entry from the stream's fields; a job field that does not decode is kept as
        malformed (`job` None), to be dead-lettered verbatim."""
        raw = fields.get(b"job", b"")
        try:
            job: EncodeJob | None = decode_job(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            job = None
        return cls(entry_id, job, raw, deliveries)


@contextlib.asynccontextmanager
async def keep_claimed(
    client: Redis | RedisCluster,
    stream: str,
    consumer: str,
    entries: list[StreamEntry],
    claim_idle_ms: int,
) -> AsyncIterator[None]:
    """While a long step runs (an encode, a switch of encoder), keep resetting its jobs'
    idle time (XCLAIM JUSTID does not count a delivery), so other workers do not take them
    over as stalled. Ended by a flag as well as a cancel: redis-py may absorb a cancel that
    lands inside a command, and the task must not outlive the step."""
    ids = [e.entry_id for e in entries]
    done = asyncio.Event()

    async def keep() -> None:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), max(claim_idle_ms / 3000, 0.05))
                return
            try:
                await client.xclaim(stream, GROUP, consumer, 0, ids, justid=True)
            except Exception as exc:  # a missed heartbeat costs at most a duplicate encode
                log.warning("worker.heartbeat_failed", error=str(exc))

    task = asyncio.create_task(keep(), name="keep jobs claimed")
    try:
        yield
    finally:
        done.set()
        task.cancel()


class BatchCommit:
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

    def ack(self, entry: StreamEntry) -> None:
        self._acks.append(entry.entry_id)
        self.acked += 1

    def store(self, entry: StreamEntry, image: EncodedImage) -> None:
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

    def requeue(self, entry: StreamEntry) -> None:
        assert entry.job is not None
        # every delivery of this entry was a run (those lost with dead workers included)
        job = msgspec.structs.replace(entry.job, attempt=entry.job.attempt + entry.deliveries)
        self._stream_step.xadd(self._stream, {"job": encode_job(job)})
        self.ack(entry)

    def dead(
        self, entry: StreamEntry, reason: str, attempts: int, code: str = "dead_letter"
    ) -> None:
        self._outcomes.xadd(
            DEAD_STREAM,
            {"job": entry.raw, "reason": reason, "consumer": self.consumer, "attempts": attempts},
            maxlen=DEAD_MAXLEN,
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
