"""Encoder jobs on a real 3-master Redis Cluster: `RedisEncoder` (gateway side) and real
`visiongate worker` processes over `redis+cluster://`.

The job stream, the result lists, the image store, the vision cache and the dead-letter stream
hash to different masters, so one job's steps go to several nodes, each command naming keys of
one slot. One pool of worker processes serves the whole module (they take the encoder from the
gateway's published spec, a tiny CLIP checkpoint, so they start and encode quickly); the
cluster is flushed after each test and the workers carry on across it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from encoder_worker import EncodedImage, EncoderConfig, ImageError
from encoder_worker.jobs import decode_spec
from encoder_worker.redis_conn import async_client
from encoder_worker.storage import (
    DEAD_STREAM,
    GROUP,
    JOBS_STREAM,
    current_spec_key,
    image_key,
    spec_key,
    vision_key,
    workers_key,
)
from gateway.encoders import redis_encoder
from gateway.encoders.redis_encoder import RedisEncoder, live_workers
from gateway.protocol.errors import GatewayError
from gateway.testing.waiting import eventually
from tests.conftest import unique_photo

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = 48
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket")


class WorkerPool:
    """`visiongate worker` processes on the cluster, named w1, w2, ... as consumers. Each waits
    up to 2 s per XREADGROUP, which leaves time to freeze one while it waits."""

    def __init__(self, url: str, log_dir: Path) -> None:
        self.url = url
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.killed: set[str] = set()

    def spawn(self) -> str:
        name = f"w{len(self.procs) + 1}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("VISIONGATE_")}
        with self.log(name).open("wb") as out:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli.main", "worker", "--redis-url", self.url,
                 "--device", "cpu", "--consumer", name, "--block-ms", "2000",
                 "--claim-idle-ms", "1000", "--max-batch", "4"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        return name

    def log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if n not in self.killed and p.poll() is None]

    def kill(self, name: str) -> None:
        self.killed.add(name)
        os.kill(self.procs[name].pid, signal.SIGKILL)
        assert self.procs[name].wait(30) == -signal.SIGKILL

    def signal_alive(self, sig: int) -> None:
        for name in self.alive():
            os.kill(self.procs[name].pid, sig)

    async def ready(self, enc: RedisEncoder, n: int = 2) -> list[str]:
        """Start workers until `n` run, and wait until each has adopted `enc`'s published
        encoder and sent a heartbeat under it."""
        while len(self.alive()) < n:
            self.spawn()
        names = self.alive()[:n]
        client = async_client(self.url)
        try:
            key = workers_key(enc.deployment, enc.fingerprint)
            deadline = time.monotonic() + 180
            while not set(names) <= {m.decode() for m in await client.zrange(key, 0, -1)}:
                for name in names:
                    assert self.procs[name].poll() is None, self.log(name).read_text()[-4000:]
                assert time.monotonic() < deadline, "workers never reported in"
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()
        return names

    def stop(self) -> dict[str, int]:
        """SIGTERM every worker still running; their exit statuses."""
        codes = {}
        self.signal_alive(signal.SIGCONT)
        self.signal_alive(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes


@pytest.fixture(scope="module")
def config(tiny_clip_dir: str) -> EncoderConfig:
    return EncoderConfig(tower=tiny_clip_dir, device="cpu")


@pytest.fixture(scope="module")
def pool(redis_cluster_server: str, tmp_path_factory) -> Iterator[WorkerPool]:
    """Two workers, started at once: they wait for a gateway's spec, which each test publishes."""
    workers = WorkerPool(redis_cluster_server, tmp_path_factory.mktemp("cluster-workers"))
    workers.spawn()
    workers.spawn()
    try:
        yield workers
    finally:
        codes = workers.stop()
    for name, code in codes.items():  # a clean stop on the cluster, killed ones aside
        if name not in workers.killed:
            assert code == 0, workers.log(name).read_text()[-4000:]


@contextlib.asynccontextmanager
async def gateway(url: str, config: EncoderConfig, **kw) -> AsyncIterator[RedisEncoder]:
    enc = RedisEncoder(url, config, HIDDEN, None, **{"timeout_s": 120.0, **kw})
    await enc.start()
    try:
        yield enc
    finally:
        await enc.aclose()


wait_until = functools.partial(eventually, timeout=60.0, interval=0.05)  # predicates ask Redis


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP has taken effect), from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


# -- the gateway's start, and the workers it counts -------------------------------------------


async def test_gateway_start_publishes_on_the_cluster_and_counts_live_workers(
    redis_cluster_url, raw_cluster, config, pool
) -> None:
    async with gateway(redis_cluster_url, config) as enc:
        names = await pool.ready(enc)
        # what `/readyz` asks, with a client made as it makes one
        probe = async_client(redis_cluster_url, socket_connect_timeout=2, socket_timeout=2)
        try:
            workers = await live_workers(probe, enc.deployment, enc.fingerprint)
            elsewhere = await live_workers(probe, "blue", enc.fingerprint)
        finally:
            await probe.aclose()
        image = await enc.encode(unique_photo("rocket"))
    assert workers == 2 and elsewhere == 0
    assert isinstance(image, EncodedImage) and image.fingerprint == enc.fingerprint
    assert [g["name"] for g in raw_cluster.xinfo_groups(JOBS_STREAM)] == [GROUP.encode()]
    assert raw_cluster.get(current_spec_key()).decode() == enc.fingerprint
    spec = decode_spec(raw_cluster.get(spec_key(enc.fingerprint)))
    assert (spec.fingerprint, spec.hidden_size, spec.encoder.tower) == (
        enc.fingerprint,
        HIDDEN,
        config.tower,
    )
    heartbeats = raw_cluster.zrange(workers_key("default", enc.fingerprint), 0, -1)
    assert sorted(m.decode() for m in heartbeats) == sorted(names)
    # the keys the gateway and workers use lie on more than one master
    keys = (JOBS_STREAM, current_spec_key(), workers_key("default", enc.fingerprint))
    assert len({raw_cluster.get_node_from_key(k).name for k in keys}) > 1


async def test_a_wait_longer_than_the_socket_timeout_still_gets_its_answer(
    redis_cluster_url, config, pool, monkeypatch
) -> None:
    # BLPOP is sliced below the socket timeout: one longer BLPOP would trip it (and the cluster
    # client would send it again after rediscovering the cluster)
    monkeypatch.setattr(redis_encoder, "_WAIT_SLICE_S", 0.2)
    monkeypatch.setattr(redis_encoder, "_SOCKET_TIMEOUT_S", 0.5)
    async with gateway(redis_cluster_url, config) as enc:
        await pool.ready(enc)
        pool.signal_alive(signal.SIGSTOP)
        try:
            call = asyncio.create_task(enc.encode(unique_photo("coffee")))
            await asyncio.sleep(1.5)
            assert not call.done()
        finally:
            pool.signal_alive(signal.SIGCONT)
        image = await asyncio.wait_for(call, 60)
    assert isinstance(image, EncodedImage)


# -- jobs that cannot be run -------------------------------------------------------------------


async def test_poison_jobs_end_in_the_dead_letter_stream(
    redis_cluster_url, raw_cluster, config, pool
) -> None:
    async with gateway(redis_cluster_url, config) as enc:
        names = await pool.ready(enc)
        data = unique_photo("chelsea")
        digest = hashlib.sha256(data).hexdigest()
        # other bytes under the image's key: the gateway finds the key and keeps it, the
        # worker finds bytes that do not hash to the job's digest; re-running cannot help
        raw_cluster.set(image_key(digest), unique_photo("rocket"))
        raw_cluster.xadd(JOBS_STREAM, {"job": b"\x93\x01\x02\x03"})  # not an EncodeJob
        with pytest.raises(GatewayError) as poisoned:
            await enc.encode(data)
        with pytest.raises(ImageError) as bad_image:  # a bad image is its caller's, not dead
            await enc.encode(b"this is not an image")
        good = await enc.encode(unique_photo("astronaut"))  # the workers keep serving

        r = async_client(redis_cluster_url)
        try:
            await wait_until(lambda: _dead_letters_are(r, 2), what="two dead letters")
            await wait_until(lambda: _drained(r), what="an empty job stream")
        finally:
            await r.aclose()
    assert poisoned.value.code == "internal_error"
    reason = f"image bytes corrupt: {image_key(digest)} does not hash to its digest"
    assert poisoned.value.message == f"the image could not be encoded: {reason}"
    assert bad_image.value.code == "invalid_image"
    assert isinstance(good, EncodedImage)
    dead = {f[b"reason"].decode(): f for _, f in raw_cluster.xrange(DEAD_STREAM)}
    assert set(dead) == {reason, "malformed job: b'\\x93\\x01\\x02\\x03' is not an EncodeJob"}
    assert all(f[b"consumer"].decode() in names and f[b"attempts"] == b"1" for f in dead.values())
    assert dead[reason][b"job"] != b"\x93\x01\x02\x03"
    assert not raw_cluster.exists(vision_key(enc.fingerprint, digest))


async def _dead_letters_are(r, n: int) -> bool:
    return await r.xlen(DEAD_STREAM) == n


async def _drained(r) -> bool:
    return (await r.xpending(JOBS_STREAM, GROUP))["pending"] == 0 and not await r.xlen(JOBS_STREAM)


# -- a worker killed holding jobs ---------------------------------------------------------------


async def test_a_worker_killed_holding_jobs_loses_none(
    redis_cluster_url, raw_cluster, config, pool
) -> None:
    """A worker is frozen (SIGSTOP) while it waits in XREADGROUP; Redis hands it jobs it never
    runs (they are pending at it), then it is SIGKILLed. The other worker reclaims them once
    idle for its claim_idle_ms, and every job completes: tokens cached, callers answered."""
    r = async_client(redis_cluster_url)
    try:
        async with gateway(redis_cluster_url, config) as enc:
            victim, survivor = await pool.ready(enc)
            calls, held = await _freeze_until_it_holds_jobs(r, pool, victim, enc)
            pool.kill(victim)
            results = await asyncio.wait_for(asyncio.gather(*calls), 120)
            await wait_until(lambda: _drained(r), what="no job pending")
            dead = await r.xlen(DEAD_STREAM)
    finally:
        await r.aclose()
    # every caller got its image's tokens
    digests = [hashlib.sha256(d).hexdigest() for d in calls.values()]
    assert len(set(digests)) == len(digests)
    assert all(isinstance(x, EncodedImage) for x in results)
    assert [x.digest for x in results] == digests
    for digest in digests:
        assert raw_cluster.exists(vision_key(enc.fingerprint, digest)), digest
    assert dead == 0
    # the survivor ran what the victim held
    reclaimed = [
        line for line in pool.log(survivor).read_text().splitlines() if "worker.reclaimed" in line
    ]
    for entry_id in held:
        assert any(entry_id in line for line in reclaimed), (entry_id, reclaimed)
    # the tokens are spread over the masters
    nodes = {raw_cluster.get_node_from_key(vision_key(enc.fingerprint, d)).name for d in digests}
    assert len(nodes) > 1


async def _freeze_until_it_holds_jobs(r, pool: WorkerPool, victim: str, enc: RedisEncoder):
    """Freeze `victim`, send a round of 8 distinct photos, and return once Redis has handed it
    some (the calls, keyed by their images' bytes, and the ids it holds). A worker spends its
    idle time blocked in XREADGROUP, so it is almost always frozen there; if it was not, the
    round ends without it holding anything, and another round is sent."""
    pid = pool.procs[victim].pid
    calls: dict[asyncio.Task, bytes] = {}
    for _ in range(5):
        datas = [unique_photo(PHOTOS[i % len(PHOTOS)]) for i in range(8)]
        os.kill(pid, signal.SIGSTOP)  # the jobs must follow at once: its read waits 2 s at most
        while not stopped(pid):
            await asyncio.sleep(0.001)
        calls.update({asyncio.create_task(enc.encode(d)): d for d in datas})
        deadline = time.monotonic() + 60
        while not all(c.done() for c in calls) and time.monotonic() < deadline:
            held = await r.xpending_range(JOBS_STREAM, GROUP, "-", "+", 100, consumername=victim)
            if held:
                return calls, [p["message_id"].decode() for p in held]
            await asyncio.sleep(0.02)
        os.kill(pid, signal.SIGCONT)
    raise TimeoutError(f"{victim} was never handed a job while frozen")
