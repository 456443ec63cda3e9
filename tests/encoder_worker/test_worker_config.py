"""Workers take their encoder configuration from the gateway through Redis.

A gateway with `--encoder redis` publishes its `EncoderSpec`; a worker started with no token
flags adopts it (and follows it when a gateway of its deployment starts with another one); a
worker whose explicit flag disagrees stops at startup naming the flag and both values; a job for
an encoder no worker serves reaches its caller as `busy`, not as a server fault.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import redis

from encoder_worker import EncodedImage, EncoderConfig
from encoder_worker.deployment_follower import ConfigConflict
from encoder_worker.jobs import SPEC_VERSION, decode_spec, encode_spec, make_spec
from encoder_worker.process import DEFAULT_HIDDEN_SIZE, SpecAdopter, add_worker_arguments
from encoder_worker.storage import (
    DEAD_STREAM,
    current_spec_key,
    spec_key,
    vision_key,
    workers_key,
)
from encoder_worker.worker import EncoderWorker
from gateway.encoders.redis_encoder import RedisEncoder, live_workers
from gateway.protocol.errors import GatewayError
from tests.conftest import photo_bytes

ROOT = Path(__file__).resolve().parents[2]
BF16_RMS, FP32_RMS = 0.13557793, 0.13557929  # SmolLM2-135M's embedding rows, as each dtype runs


def worker_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_args(["--redis-url", "redis://unused", "--device", "cpu", *flags])


def start_worker(redis_url: str, log_path: Path, *flags: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VISIONGATE_")}
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "gateway.cli.main", "worker", "--redis-url", redis_url,
             "--device", "cpu", "--block-ms", "200", *flags],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip


def guide_scale_out(redis_url: str) -> tuple[list[str], list[str]]:
    """The scale-out guide's commands (worker, serve) as a user copies them, with only the
    Redis URL pointed at the test's server."""
    import shlex

    section = (ROOT / "docs" / "guides" / "scale-out.md").read_text()
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
    found = {}
    for argv in commands:
        at = argv.index("--redis-url")
        argv[at + 1] = redis_url
        found[argv[1]] = argv
    return found["worker"], found["serve"]


def start_guide_worker(argv: list[str], log_path: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VISIONGATE_")}
    program = ROOT / argv[0]  # .venv/bin/visiongate in a checkout set up as the quickstart says
    command = [str(program)] if program.exists() else [sys.executable, "-m", "gateway.cli.main"]
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [*command, *argv[1:]], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )


def guide_gateway_settings(argv: list[str], *extra: str):
    from gateway.cli.main import _overrides, build_parser
    from tests.gateway.conftest import gateway_settings

    args = build_parser().parse_args([*argv[1:], *extra])
    return gateway_settings(**{k: v for k, v in _overrides(args).items() if v is not None})


@contextlib.contextmanager
def running(proc: subprocess.Popen, log_path: Path) -> Iterator[subprocess.Popen]:
    """Stop the worker with SIGTERM at the end; it must exit cleanly."""
    try:
        yield proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the published document ------------------------------------------------------------------


def test_spec_round_trips_as_json_and_refuses_what_it_cannot_read() -> None:
    config = EncoderConfig(device="cpu", pruning="topk", max_pixels=1234)
    spec = make_spec(config, 576, BF16_RMS, "f" * 64, 12.5)
    raw = encode_spec(spec)
    assert raw.startswith(b"{") and decode_spec(raw) == spec  # JSON, nothing pickled
    doc = msgspec.json.decode(raw)
    assert doc["version"] == SPEC_VERSION and doc["target_rms"] == BF16_RMS
    assert doc["encoder"]["pruning"] == "topk" and "device" not in doc["encoder"]

    newer = msgspec.json.encode({**doc, "version": SPEC_VERSION + 1})
    with pytest.raises(ValueError, match=f"version {SPEC_VERSION + 1}.*same visiongate release"):
        decode_spec(newer)
    unknown = msgspec.json.encode({**doc, "encoder": {**doc["encoder"], "dither": 3}})
    with pytest.raises(ValueError, match="malformed encoder spec.*dither"):
        decode_spec(unknown)
    with pytest.raises(ValueError, match="not an encoder spec"):
        decode_spec(b"\x80\x04pickle")


def test_explicit_flags_are_checked_against_the_spec_without_building() -> None:
    config = EncoderConfig(device="cpu")
    from encoder_worker.pipeline import encoder_fingerprint

    spec = make_spec(config, 576, BF16_RMS, encoder_fingerprint(config, 576, BF16_RMS))
    adopted, hidden, rms = SpecAdopter(worker_args(), config).resolve(spec)
    assert (adopted, hidden, rms) == (config, 576, BF16_RMS)
    same = SpecAdopter(worker_args("--pruning", "dynamic", "--target-rms", repr(BF16_RMS)), config)
    assert same.resolve(spec)[2] == BF16_RMS  # an explicit value the gateway shares is fine
    wrong = SpecAdopter(worker_args("--target-rms", repr(FP32_RMS), "--pruning", "topk"), config)
    with pytest.raises(ConfigConflict) as exc:
        wrong.resolve(spec)
    message = str(exc.value)
    assert f"--target-rms {FP32_RMS!r} differs from the gateway's {BF16_RMS!r}" in message
    assert "--pruning topk differs from the gateway's dynamic" in message
    assert "without --pruning and --target-rms" in message
    missing = msgspec.structs.replace(spec, encoder=msgspec.structs.replace(
        spec.encoder, tower="/nowhere/clip"))  # fmt: skip
    with pytest.raises(ConfigConflict, match="cannot adopt the gateway's encoder.*/nowhere/clip"):
        SpecAdopter(worker_args(), config).resolve(missing)


# -- worker processes with a real gateway ------------------------------------------------------


def _ask(base_url: str, image: bytes) -> dict:
    from openai import OpenAI

    from gateway.testing.realtime_peer import data_url

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    completion = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        max_tokens=3,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(image)}},
                    {"type": "text", "text": "What is in the picture?"},
                ],
            }
        ],
    )
    assert completion.choices[0].message.content
    return completion.usage.model_extra["visiongate"]


@pytest.mark.slow
def test_the_scale_out_guide_commands_serve_bfloat16_then_float32_gateways(
    redis_url, tmp_path
) -> None:
    """The scale-out guide's worker command (docs/guides/scale-out.md), run as written, serves a
    gateway started with the guide's serve command under each `--lm-dtype`: the worker has no
    token flags and adopts each."""
    from gateway.server.app import create_app
    from gateway.server.runner import ServerThread

    worker_argv, serve_argv = guide_scale_out(redis_url)
    assert worker_argv[1:] == ["worker", "--redis-url", redis_url]  # no copied numbers
    log_path = tmp_path / "worker.log"
    r = redis.Redis.from_url(redis_url)
    fingerprints = []
    with running(start_guide_worker(worker_argv, log_path), log_path) as proc:
        for dtype, rms, name in (
            ("bfloat16", BF16_RMS, "chelsea"),
            ("float32", FP32_RMS, "coffee"),
        ):
            settings = guide_gateway_settings(serve_argv, "--lm-dtype", dtype)
            assert (settings.encoder, settings.redis_url) == ("redis", redis_url)
            with ServerThread(create_app(settings), settings) as server:
                # ready only once a worker serves this gateway's encoder: the worker adopted it
                server.wait_ready(timeout=300)
                fingerprint = r.get(current_spec_key()).decode()
                spec = decode_spec(r.get(spec_key(fingerprint)))
                assert (spec.target_rms, spec.hidden_size) == (rms, DEFAULT_HIDDEN_SIZE)
                image = photo_bytes(name, size=224)
                usage = _ask(server.http_url, image)
                assert usage["image_tokens"] > 0, usage
                digest = hashlib.sha256(image).hexdigest()
                assert r.exists(vision_key(fingerprint, digest))  # the worker wrote the tokens
                fingerprints.append(fingerprint)
            assert proc.poll() is None, log_path.read_text()[-4000:]
    output = log_path.read_text()
    (tmp_path.parent / "kept-worker.log").write_text(output)
    assert fingerprints[0] != fingerprints[1]
    assert output.count("worker.adopted") == 2 and "worker.reconfigured" in output, output[-4000:]
    assert "fingerprint mismatch" not in output and '"worker.dead_letter"' not in output
    assert r.xlen(DEAD_STREAM) == 0
    r.close()


def test_a_worker_with_a_wrong_explicit_target_rms_exits_at_startup(redis_url, tmp_path) -> None:
    async def publish() -> str:
        gateway = RedisEncoder(redis_url, EncoderConfig(device="cpu"), 576, BF16_RMS)
        await gateway.start()
        await gateway.aclose()
        return gateway.fingerprint

    fingerprint = asyncio.run(publish())
    log_path = tmp_path / "worker.log"
    proc = start_worker(redis_url, log_path, "--target-rms", repr(FP32_RMS))
    try:
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log_path.read_text()
    assert code == 2, output[-4000:]
    assert (
        f"visiongate worker: configuration error: --target-rms {FP32_RMS!r} differs from the "
        f"gateway's {BF16_RMS!r} (deployment 'default', gateway encoder {fingerprint[:16]}): "
        "start the worker without --target-rms to take the gateway's values"
    ) in output, output[-4000:]
    assert "worker.started" not in output  # it never joined the job stream


# -- following the deployment, in process ------------------------------------------------------


async def test_a_following_worker_switches_and_old_gateways_get_busy(
    redis_url, tiny_clip_dir, photos
) -> None:
    config = EncoderConfig(tower=tiny_clip_dir, device="cpu")
    first = RedisEncoder(redis_url, config, 48, None, timeout_s=60)
    second = RedisEncoder(redis_url, config, 48, 0.5, timeout_s=60)
    assert first.fingerprint != second.fingerprint
    await first.start()
    adopter = SpecAdopter(worker_args(), EncoderConfig(device="cpu"))
    worker = EncoderWorker(
        redis_url, adopter.build(first.spec()), block_ms=100, build=adopter.build, heartbeat_s=0.1
    )
    stop = asyncio.Event()
    await worker.start()
    task = asyncio.create_task(worker.run_until(stop))
    r = redis.asyncio.Redis.from_url(redis_url)
    try:
        assert await live_workers(r, "default", first.fingerprint) == 1
        assert isinstance(await first.encode(photos["astronaut"]), EncodedImage)
        await second.start()  # a gateway of the deployment restarted with another setting
        image = await second.encode(photos["chelsea"])  # the worker follows at once
        assert isinstance(image, EncodedImage) and image.fingerprint == second.fingerprint
        assert worker.fingerprint == second.fingerprint and worker.reconfigured == 1
        with pytest.raises(GatewayError) as exc:  # the replaced gateway's jobs
            await first.encode(photos["coffee"])
        assert exc.value.code == "busy" and exc.value.http_status == 503
        assert "no encoder worker serves this gateway's encoder configuration" in str(exc.value)
        assert "target RMS: job None, worker 0.5" in exc.value.message
        deadline = time.monotonic() + 30
        while await live_workers(r, "default", first.fingerprint):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert await live_workers(r, "default", second.fingerprint) == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await worker.aclose()
        worker.pipeline.close()
        await first.aclose()
        await second.aclose()
    assert await r.zcard(workers_key("default", second.fingerprint)) == 0  # left on close
    await r.aclose()


async def test_two_deployments_on_one_redis_do_not_clash(redis_url, tiny_clip_dir, photos) -> None:
    config = EncoderConfig(tower=tiny_clip_dir, device="cpu")
    gateways = {
        "default": RedisEncoder(redis_url, config, 48, None, timeout_s=60),
        "blue": RedisEncoder(redis_url, config, 48, 0.5, timeout_s=60, deployment="blue"),
    }
    workers = {}
    stop = asyncio.Event()
    for name, gateway in gateways.items():
        await gateway.start()
        adopter = SpecAdopter(worker_args("--deployment", name), EncoderConfig(device="cpu"))
        workers[name] = EncoderWorker(
            redis_url,
            adopter.build(gateway.spec()),
            block_ms=100,
            build=adopter.build,
            deployment=name,
            heartbeat_s=0.1,
        )
        await workers[name].start()
    tasks = [asyncio.create_task(w.run_until(stop)) for w in workers.values()]
    try:
        images = await asyncio.gather(
            gateways["default"].encode(photos["rocket"]), gateways["blue"].encode(photos["rocket"])
        )
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        for name in gateways:
            await workers[name].aclose()
            workers[name].pipeline.close()
            await gateways[name].aclose()
    assert [i.fingerprint for i in images] == [g.fingerprint for g in gateways.values()]
    assert [(w.encoded, w.reconfigured, w.dead_lettered) for w in workers.values()] == [
        (1, 0, 0)
    ] * 2
    r = redis.Redis.from_url(redis_url)
    try:
        assert r.get(current_spec_key("blue")).decode() == gateways["blue"].fingerprint
        assert r.get(current_spec_key()).decode() == gateways["default"].fingerprint
    finally:
        r.close()
