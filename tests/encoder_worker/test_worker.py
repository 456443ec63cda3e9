"""Encoder workers on a real redis-server: `RedisEncoder` (gateway side) + `EncoderWorker`.

Workers run in-process (sharing one pipeline) where the test is about the queue, and as real
processes where it is about process death (a worker killed with SIGKILL from outside), signals
and telemetry (`python -m gateway.cli.main worker`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest

from encoder_worker import (
    EncodedImage,
    Encoder,
    EncoderConfig,
    EncoderPipeline,
    ImageError,
    LocalEncoder,
)
from encoder_worker.jobs import (
    EncodeDone,
    EncodeFailed,
    EncodeJob,
    decode_job,
    decode_result,
    encode_job,
    encode_result,
)
from encoder_worker.process import DEFAULT_HIDDEN_SIZE, DEFAULT_TARGET_RMS
from encoder_worker.storage import (
    DEAD_STREAM,
    GROUP,
    JOBS_STREAM,
    image_key,
    result_key,
    unpack_encoded,
    vision_key,
)
from encoder_worker.worker import EncoderWorker
from gateway.encoders.redis_encoder import RedisEncoder
from gateway.protocol.errors import GatewayError
from gateway.testing.waiting import eventually
from tests.conftest import photo_bytes

ROOT = Path(__file__).resolve().parents[2]
CONFIG = EncoderConfig(device="cpu")
HIDDEN, RMS = DEFAULT_HIDDEN_SIZE, DEFAULT_TARGET_RMS


@pytest.fixture(scope="module")
def pipeline() -> Iterator[EncoderPipeline]:
    p = EncoderPipeline(CONFIG, HIDDEN, RMS)
    yield p
    p.close()


@pytest.fixture(scope="module")
def images() -> dict[str, bytes]:
    return {
        name: photo_bytes(name, size=224) for name in ("astronaut", "chelsea", "coffee", "rocket")
    }


@contextlib.asynccontextmanager
async def remote(redis_url: str, **kw) -> AsyncIterator[RedisEncoder]:
    kw.setdefault("timeout_s", 60.0)
    hidden = kw.pop("hidden_size", HIDDEN)
    rms = kw.pop("target_rms", RMS)
    enc = RedisEncoder(redis_url, kw.pop("config", CONFIG), hidden, rms, **kw)
    await enc.start()
    try:
        yield enc
    finally:
        await enc.aclose()


@contextlib.asynccontextmanager
async def serving(worker: EncoderWorker) -> AsyncIterator[EncoderWorker]:
    """Run `worker` in the background of this event loop until the block ends."""
    stop = asyncio.Event()
    await worker.start()
    task = asyncio.create_task(worker.run_until(stop))
    try:
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await worker.aclose()


def make_worker(redis_url: str, pipeline: EncoderPipeline, **kw) -> EncoderWorker:
    kw.setdefault("block_ms", 100)
    return EncoderWorker(redis_url, pipeline, **kw)


async def _client(redis_url: str):
    from redis.asyncio import Redis

    return Redis.from_url(redis_url)


wait_until = functools.partial(eventually, timeout=30.0, interval=0.05)  # predicates ask Redis


def worker_process(redis_url: str, log_path: Path, *args: str, env: dict[str, str] | None = None):
    full_env = {**os.environ, **(env or {})}
    log = log_path.open("wb")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli.main",
            "worker",
            "--redis-url",
            redis_url,
            "--device",
            "cpu",
            "--block-ms",
            "200",
            *args,
        ],
        cwd=ROOT,
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


# -- formats ---------------------------------------------------------------------------------


def test_worker_job_and_result_formats_round_trip() -> None:
    job = EncodeJob("j1", "a" * 64, "f" * 64, 576, 0.5, None, 123, attempt=2)
    assert decode_job(encode_job(job)) == job
    for result in (EncodeDone("j1", "w", 17), EncodeFailed("j1", "invalid_image", "broken")):
        assert decode_result(encode_result(result)) == result
    with pytest.raises(msgspec.DecodeError):
        decode_job(b"\xc1junk")


def test_worker_cli_help_and_settings(capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli.main import build_parser, main
    from gateway.settings import Settings, SettingsError

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["worker", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--redis-url",
        "--consumer",
        "--claim-idle-ms",
        "--max-attempts",
        "--hidden-size",
        "--target-rms",
        "--max-batch",
        "--vision-tower",
        "--pruning",
        "--device",
    ):
        assert flag in out
    env = {k: v for k, v in os.environ.items() if k != "VISIONGATE_REDIS_URL"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "environ", env)
        assert main(["worker", "--redis-url", ""]) == 2
    assert Settings(encoder="redis", redis_url="redis://127.0.0.1:1/0").encoder == "redis"
    with pytest.raises(SettingsError, match="ENCODER"):
        Settings(encoder="redis")
    with pytest.raises(SettingsError, match="ENCODER"):
        Settings(encoder="gpu-farm")


# -- in-process worker -----------------------------------------------------------------------


async def test_remote_encode_matches_local_and_fills_the_vision_cache(
    redis_url, pipeline, images
) -> None:
    from gateway.caching import MemoryVisionCache, TieredVisionCache

    local = LocalEncoder(CONFIG, HIDDEN, RMS)
    await local.start()
    try:
        expected = await local.encode(images["astronaut"])
    finally:
        await local.aclose()

    async with remote(redis_url) as enc, serving(make_worker(redis_url, pipeline)) as worker:
        assert isinstance(enc, Encoder)
        assert enc.fingerprint == local.fingerprint == pipeline.fingerprint
        got = await enc.encode(images["astronaut"])
    assert isinstance(got, EncodedImage) and worker.encoded == 1
    assert got.payload.to_bytes() == expected.payload.to_bytes()
    assert (got.digest, got.fingerprint, got.tokens_kept, got.hidden_size) == (
        expected.digest,
        expected.fingerprint,
        expected.tokens_kept,
        HIDDEN,
    )

    # the entry is where, and as, the gateway's own vision cache reads it
    cache = TieredVisionCache(MemoryVisionCache(0), redis_url, ttl_s=60)
    try:
        assert cache.key(got.fingerprint, got.digest) == vision_key(got.fingerprint, got.digest)
        hit = await cache.get(got.fingerprint, got.digest)
    finally:
        await cache.aclose()
    assert hit is not None and hit.tier == "redis"
    assert unpack_encoded(hit.payload).payload.to_bytes() == expected.payload.to_bytes()

    r = await _client(redis_url)
    try:
        assert await r.exists(image_key(got.digest))
        assert await r.xlen(JOBS_STREAM) == 0  # acked jobs are deleted: the stream holds only work
        assert (await r.xpending(JOBS_STREAM, GROUP))["pending"] == 0
        assert 0 < await r.pttl(vision_key(got.fingerprint, got.digest)) <= 86400 * 1000
    finally:
        await r.aclose()


async def test_remote_bad_image_fails_its_caller_only(redis_url, pipeline, images) -> None:
    worker = make_worker(redis_url, pipeline)
    async with remote(redis_url) as enc:
        await worker.start()
        try:
            calls = [
                asyncio.create_task(enc.encode(d))
                for d in (
                    images["chelsea"],
                    b"this is not an image",
                    images["coffee"][:300],
                    images["rocket"],
                )
            ]
            r = await _client(redis_url)
            try:
                await wait_until(lambda: _xlen_is(r, 4), what="4 queued jobs")
            finally:
                await r.aclose()
            t0 = time.perf_counter()
            assert await worker.run_once() == 4  # one batch
            results = await asyncio.gather(*calls, return_exceptions=True)
            assert time.perf_counter() - t0 < 5
        finally:
            await worker.aclose()
    assert isinstance(results[0], EncodedImage) and isinstance(results[3], EncodedImage)
    for bad in results[1:3]:
        assert isinstance(bad, ImageError) and bad.code == "invalid_image", bad
    assert results[0].timings_ms["batch_size"] == 2
    assert (worker.encoded, worker.failed, worker.dead_lettered, worker.requeued) == (2, 2, 0, 0)


async def _xlen_is(r, n: int) -> bool:
    return await r.xlen(JOBS_STREAM) == n


async def test_worker_poison_job_is_retried_then_dead_lettered(
    redis_url, pipeline, images, monkeypatch
) -> None:
    poison = images["coffee"]
    real = pipeline.encode_batch
    runs: list[int] = []

    def crashing(datas: list[bytes]):
        if poison in datas:
            runs.append(len(datas))
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(datas)

    monkeypatch.setattr(pipeline, "encode_batch", crashing)
    async with (
        remote(redis_url) as enc,
        serving(make_worker(redis_url, pipeline, max_attempts=3)) as worker,
    ):
        with pytest.raises(GatewayError) as exc:
            await enc.encode(poison)
        assert exc.value.code == "internal_error"
        assert (
            "encoding failed 3 times" in exc.value.message
            and "illegal memory access" in exc.value.message
        )
        good = await enc.encode(images["rocket"])  # the worker keeps serving
    assert isinstance(good, EncodedImage)
    assert len(runs) == 3 and worker.requeued == 2 and worker.dead_lettered == 1

    r = await _client(redis_url)
    try:
        dead = await r.xrange(DEAD_STREAM)
        assert await r.xlen(JOBS_STREAM) == 0
    finally:
        await r.aclose()
    assert len(dead) == 1
    fields = dead[0][1]
    job = decode_job(fields[b"job"])
    assert job.attempt == 2 and job.fingerprint == pipeline.fingerprint
    assert b"encoding failed 3 times" in fields[b"reason"] and fields[b"attempts"] == b"3"


async def test_worker_refuses_jobs_for_another_encoder(redis_url, pipeline, images) -> None:
    async with (
        remote(redis_url, hidden_size=960) as wide,
        remote(redis_url, target_rms=0.5) as scaled,
        remote(redis_url, config=EncoderConfig(device="cpu", pruning="topk")) as topk,
        serving(make_worker(redis_url, pipeline)) as worker,
    ):
        results = await asyncio.gather(
            *(e.encode(images["chelsea"]) for e in (wide, scaled, topk)), return_exceptions=True
        )
    for result in results:  # a stable, retryable code: not a server fault
        assert isinstance(result, GatewayError) and result.code == "busy", result
        assert "fingerprint mismatch" in result.message
        assert "serves one fixed configuration" in result.message
    assert "hidden size: job 960, worker 576" in results[0].message
    assert f"target RMS: job 0.5, worker {RMS!r}" in results[1].message
    assert "encoder config differs" in results[2].message
    assert worker.encoded == 0 and worker.dead_lettered == 3
    r = await _client(redis_url)
    try:
        reasons = sorted(f[b"reason"].decode() for _, f in await r.xrange(DEAD_STREAM))
    finally:
        await r.aclose()
    assert (
        sorted(
            e.message.removeprefix(
                "no encoder worker serves this gateway's encoder configuration: "
            )
            for e in results
        )
        == reasons
    )


async def test_worker_dead_letters_jobs_it_cannot_run(redis_url, pipeline, images) -> None:
    import hashlib

    r = await _client(redis_url)
    worker = make_worker(redis_url, pipeline)
    await worker.start()
    try:
        data = images["chelsea"]
        digest = hashlib.sha256(data).hexdigest()
        gone = EncodeJob("gone", digest, pipeline.fingerprint, HIDDEN, RMS, None, time.time_ns())
        other = hashlib.sha256(images["rocket"]).hexdigest()
        await r.set(image_key(other), data)  # bytes that do not hash to their key
        corrupt = EncodeJob(
            "corrupt", other, pipeline.fingerprint, HIDDEN, RMS, None, time.time_ns()
        )
        for job in (gone, corrupt):
            await r.xadd(JOBS_STREAM, {"job": encode_job(job)})
        await r.xadd(JOBS_STREAM, {"job": b"\x93\x01\x02\x03"})
        assert await worker.run_once() == 3
        results = {
            job_id: decode_result((await r.blpop([result_key(job_id)], 5))[1])
            for job_id in ("gone", "corrupt")
        }
        dead = [f[b"reason"].decode() for _, f in await r.xrange(DEAD_STREAM)]
        assert await r.xlen(JOBS_STREAM) == 0
    finally:
        await worker.aclose()
        await r.aclose()
    assert all(isinstance(x, EncodeFailed) and x.code == "dead_letter" for x in results.values())
    assert "image bytes gone" in results["gone"].message
    assert "does not hash to its digest" in results["corrupt"].message
    assert sorted(dead) == sorted(
        [
            results["gone"].message,
            results["corrupt"].message,
            next(d for d in dead if d.startswith("malformed job")),
        ]
    )
    assert worker.dead_lettered == 3 and worker.encoded == 0


async def test_worker_recreates_its_group_after_redis_loses_it(redis_url, pipeline, images) -> None:
    async with remote(redis_url) as enc, serving(make_worker(redis_url, pipeline)) as worker:
        assert isinstance(await enc.encode(images["rocket"]), EncodedImage)
        r = await _client(redis_url)
        try:
            await r.flushall()  # stream, group, images and cache gone, as with a fresh Redis
        finally:
            await r.aclose()
        assert isinstance(await enc.encode(images["rocket"]), EncodedImage)
    assert worker.encoded == 2


async def test_remote_times_out_as_busy_without_workers(redis_url, images) -> None:
    async with remote(redis_url, timeout_s=0.3) as enc:
        with pytest.raises(GatewayError) as exc:
            await enc.encode(images["rocket"])
        with pytest.raises(ImageError) as too_large:
            await enc.encode(b"\xff" * (CONFIG.max_image_bytes + 1))
    assert exc.value.code == "busy"
    assert too_large.value.code == "image_too_large"


# -- worker processes ------------------------------------------------------------------------


# A worker process whose pipeline takes a batch and never finishes it: killed from outside while
# it holds a job, it dies at a known point (job read, not acked) without any hook in the worker.
STUCK_WORKER = """
import asyncio, sys, threading, types
from encoder_worker.worker import EncoderWorker

class StuckPipeline:
    hidden_size = target_rms = None
    config = types.SimpleNamespace(max_batch=8)

    def __init__(self, fingerprint):
        self.fingerprint = fingerprint

    def encode_batch(self, datas):
        print("encoding", len(datas), flush=True)
        threading.Event().wait()

redis_url, consumer, fingerprint = sys.argv[1:]
worker = EncoderWorker(redis_url, StuckPipeline(fingerprint), consumer=consumer, block_ms=200)
asyncio.run(worker.run_until(asyncio.Event()))
"""


def stuck_worker_process(redis_url: str, fingerprint: str, log_path: Path) -> subprocess.Popen:
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-c", STUCK_WORKER, redis_url, "doomed", fingerprint],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


async def test_worker_killed_mid_job_loses_nothing(redis_url, pipeline, images, tmp_path) -> None:
    log_path = tmp_path / "doomed.log"
    doomed = stuck_worker_process(redis_url, pipeline.fingerprint, log_path)

    async def encoding() -> bool:
        assert doomed.poll() is None, log_path.read_text()
        return "encoding 1" in log_path.read_text()

    try:
        async with remote(redis_url) as enc:
            call = asyncio.create_task(enc.encode(images["astronaut"]))
            await wait_until(encoding, timeout=60, what="the doomed worker encoding the job")
            os.kill(doomed.pid, signal.SIGKILL)
            code = await asyncio.to_thread(doomed.wait, 30)
            assert code == -signal.SIGKILL, log_path.read_text()
            r = await _client(redis_url)
            try:
                pending = await r.xpending_range(JOBS_STREAM, GROUP, "-", "+", 10)
            finally:
                await r.aclose()
            assert [p["consumer"] for p in pending] == [b"doomed"]  # read, never acked
            assert not call.done()
            async with serving(make_worker(redis_url, pipeline, claim_idle_ms=300)) as rescuer:
                image = await asyncio.wait_for(call, 60)
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait()
    assert isinstance(image, EncodedImage) and image.tokens_kept > 0
    assert rescuer.reclaimed == 1 and rescuer.encoded == 1


async def test_worker_spans_join_the_callers_trace(redis_url, images, tmp_path) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    from gateway.telemetry import traceparent
    from gateway.testing.otlp_receiver import OTLPReceiver

    tracer = TracerProvider().get_tracer("test")
    with OTLPReceiver() as receiver:
        proc = worker_process(
            redis_url,
            tmp_path / "worker.log",
            "--consumer",
            "traced",
            env={
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_SERVICE_NAME": "",
            },
        )
        try:
            async with remote(redis_url) as enc:
                with tracer.start_as_current_span("image.resolve") as caller:
                    image = await enc.encode(images["chelsea"], traceparent=traceparent(caller))
                await enc.encode(images["rocket"])  # a pre-encode: no caller span
            proc.send_signal(signal.SIGTERM)  # graceful: flushes spans and metrics on the way out
            assert await asyncio.to_thread(proc.wait, 60) == 0, (
                tmp_path / "worker.log"
            ).read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        spans = receiver.wait_for_spans(lambda s: any(x.name == "cache.put" for x in s))
        points = receiver.wait_for_metrics(
            lambda p: any(x.name == "visiongate.encode.batch.size" for x in p)
        )
    assert isinstance(image, EncodedImage)
    ctx = caller.get_span_context()
    trace_id, span_id = f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
    ours = [s for s in spans if s.trace_id == trace_id]
    names = {s.name for s in ours}
    expected = {
        "encode.queue",
        "encode.decode",
        "encode.preprocess",
        "encode.vision",
        "encode.prune",
        "encode.quantize",
        "cache.put",
    }
    assert expected <= names, names
    assert all(s.parent_span_id == span_id for s in ours)
    assert {s.resource["service.name"] for s in ours} == {"visiongate-encoder"}
    by_name = {s.name: s for s in ours}
    assert by_name["encode.vision"].attributes["visiongate.encode.batch_size"] == 1
    assert (
        by_name["cache.put"].start_time_unix_nano >= by_name["encode.quantize"].end_time_unix_nano
    )
    assert any(p.resource.get("service.name") == "visiongate-encoder" for p in points)
    roots = [s for s in spans if s.name == "encode.job"]  # the job without a caller span
    assert len(roots) == 1 and roots[0].parent_span_id == "" and roots[0].trace_id != trace_id
    children = {s.name for s in spans if s.parent_span_id == roots[0].span_id}
    assert expected <= children, children
    r = await _client(redis_url)
    try:  # a clean exit leaves the group
        assert [c["name"] for c in await r.xinfo_consumers(JOBS_STREAM, GROUP)] == []
    finally:
        await r.aclose()


# -- the gateway ------------------------------------------------------------------------------


@pytest.mark.slow
async def test_gateway_in_redis_mode_answers_about_an_image(redis_url, pipeline, images) -> None:
    from gateway.server.app import create_app
    from gateway.server.runner import ServerThread
    from gateway.testing.realtime_peer import Peer, data_url
    from tests.gateway.conftest import gateway_settings

    settings = gateway_settings(encoder="redis", redis_url=redis_url)
    async with serving(make_worker(redis_url, pipeline)) as worker:
        with ServerThread(create_app(settings), settings) as server:
            await asyncio.to_thread(server.wait_ready)
            encoder = server.app.state["gateway"].require().encoder
            assert isinstance(encoder, RedisEncoder)
            # the worker's defaults fit the engine
            assert encoder.fingerprint == pipeline.fingerprint
            peer = await Peer.open(server.ws_url)
            try:
                await peer.add(
                    [
                        {"type": "input_image", "image_url": data_url(images["rocket"])},
                        {"type": "input_text", "text": "What is in the picture?"},
                    ]
                )
                done, _ = await peer.respond(max_output_tokens=4)
            finally:
                await peer.close()
    response = done["response"]
    assert response["status"] in ("completed", "incomplete"), response  # incomplete: max tokens
    assert response["output"][0]["content"][0]["text"]
    assert response["usage"]["input_token_details"]["image_tokens"] > 0
    assert worker.encoded == 1 and worker.dead_lettered == 0
