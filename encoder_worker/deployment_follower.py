"""Which encoder a worker serves: its heartbeat, and following its deployment's gateways.

A `DeploymentFollower` holds the pipeline its worker serves and that pipeline's fingerprint.
Every `heartbeat_s` it records the worker (as consumer `consumer`) under that fingerprint in the
deployment's workers' set (gateways count live workers for `/readyz`) and reads the fingerprint
the deployment's gateways last published. Given `build` (spec -> warmed-up pipeline), it
follows that fingerprint: `follow()` reads the published `EncoderSpec`, builds its pipeline on
the worker's thread and serves it from then on (the old pipeline is closed, the heartbeat moves
to the new fingerprint). It never switches on its own in the middle of a batch: the heartbeat
only notes the wanted fingerprint (`wanted`), and the worker calls `follow` between batches, or
at once when a job names another encoder. Without `build` the encoder is fixed and nothing is
followed.

A published spec that does not decode, or `build` refusing it, raises `ConfigConflict`: the
worker cannot serve its deployment's encoder, and ends with that error. Keys: `storage.py`; the
gateways' side of publishing: `gateway.encoders.redis_encoder`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from encoder_worker.jobs import EncodeJob, EncoderSpec, decode_spec
from encoder_worker.storage import WORKER_LIVE_S, current_spec_key, spec_key, workers_key

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from redis.asyncio import Redis, RedisCluster

    from encoder_worker.pipeline import EncoderPipeline

__all__ = ("ConfigConflict", "DeploymentFollower", "read_current_spec")

# the worker's own events: one logger for everything a worker process says about its loop
log = structlog.get_logger("encoder_worker.worker")


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


async def read_current_spec(client: Redis | RedisCluster, deployment: str) -> EncoderSpec | None:
    """The encoder spec the deployment's gateways last published, or None if there is none
    yet; ValueError if it does not decode (another release's, or damaged)."""
    fingerprint = await client.get(current_spec_key(deployment))
    if not fingerprint:
        return None
    raw = await client.get(spec_key(fingerprint.decode()))
    return None if raw is None else decode_spec(raw)


class DeploymentFollower:
    """The encoder one worker serves (`pipeline`, `fingerprint`), kept recorded under its
    deployment and, given `build`, kept equal to the one the deployment's gateways publish.

    `start(client, executor)` registers the heartbeat, sends the first one and keeps beating
    until `aclose()`, which also takes the worker out of the workers' set (the client stays
    open: it is the worker's). `mismatch(job)` says why a job's encoder is not the one served,
    in the words its caller is told."""

    __slots__ = (
        "_beat_lock",
        "_build",
        "_client",
        "_closing",
        "_executor",
        "_script",
        "_task",
        "consumer",
        "deployment",
        "fingerprint",
        "heartbeat_s",
        "pipeline",
        "reconfigured",
        "wanted",
    )

    def __init__(
        self,
        pipeline: EncoderPipeline,
        *,
        consumer: str,
        deployment: str,
        build: Callable[[EncoderSpec], EncoderPipeline] | None,
        heartbeat_s: float,
    ) -> None:
        self.pipeline = pipeline
        self.fingerprint = pipeline.fingerprint
        self.consumer = consumer
        self.deployment = deployment
        self.heartbeat_s = heartbeat_s
        self._build = build
        self._client: Redis | RedisCluster | None = None
        self._executor: Executor | None = None
        self._script: Any = None  # the _HEARTBEAT script, registered on start
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()  # ends the heartbeat even if a cancel goes astray
        self._beat_lock = asyncio.Lock()  # no heartbeat lands under a fingerprint just left
        self.wanted: str | None = None  # the deployment's fingerprint, when not ours
        self.reconfigured = 0

    @property
    def follows(self) -> bool:
        """Whether this worker adopts the encoder its deployment publishes (it has `build`)."""
        return self._build is not None

    def mismatch(self, job: EncodeJob) -> str | None:
        """Why the job's encoder is not the one served, or None when it is: what differs, and
        why the worker does not serve it (its caller is told `encoder_mismatch`)."""
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
            if self.follows
            else "this worker serves one fixed configuration"
        )
        return f"{head}; {what} ({why})"

    async def start(self, client: Redis | RedisCluster, executor: Executor) -> None:
        """Register the heartbeat, send the first one, keep beating in the background;
        `executor` runs `build`."""
        self._client, self._executor = client, executor
        self._script = client.register_script(_HEARTBEAT)
        await self.beat()
        self._closing.clear()
        self._task = asyncio.create_task(self._beat_forever(), name="worker heartbeat")

    async def aclose(self) -> None:
        """Stop the heartbeat and leave the workers' set."""
        if self._task is not None:
            # the flag, not only the cancel: a cancel that lands inside a Redis call may be
            # absorbed there, and the loop must still end
            self._closing.set()
            self._task.cancel()
            await asyncio.wait([self._task], timeout=10)
            self._task = None
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.zrem(
                    workers_key(self.deployment, self.fingerprint), self.consumer
                )
            self._client = None

    async def beat(self) -> None:
        """Record this worker as serving its encoder; note the deployment's current one."""
        assert self._client is not None
        async with self._beat_lock:
            await self._script(
                keys=[workers_key(self.deployment, self.fingerprint)],
                args=[self.consumer, WORKER_LIVE_S * 6, WORKER_LIVE_S * 6],
            )
            current = await self._client.get(current_spec_key(self.deployment))
        current = current.decode() if isinstance(current, bytes) else current
        if self._build is not None and current and current != self.fingerprint:
            self.wanted = current

    async def _beat_forever(self) -> None:
        failing = False
        while not self._closing.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self.heartbeat_s)
                return
            try:
                await self.beat()
            except Exception as exc:  # Redis restarting: the read loop reports and retries too
                if not failing:
                    log.warning("worker.heartbeat_failed", error=repr(exc))
                failing = True
            else:
                failing = False

    async def follow(self, fingerprint: str | None = None) -> None:
        """If the deployment's gateways now encode with another fingerprint than ours (read
        from Redis unless given), build that encoder and serve it from now on."""
        client = self._client
        assert client is not None
        self.wanted = None
        if self._build is None:
            return
        if fingerprint is None:
            raw = await client.get(current_spec_key(self.deployment))
            fingerprint = raw.decode() if raw else None
        if not fingerprint or fingerprint == self.fingerprint:
            return
        raw = await client.get(spec_key(fingerprint))
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
                await client.zrem(workers_key(self.deployment, self.fingerprint), self.consumer)
            self.fingerprint = pipeline.fingerprint
        self.reconfigured += 1
        await self.beat()
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
