"""encoder_worker without gateway: in Python processes where `import gateway` fails, every module
of the package imports, a vision-cache entry round-trips through its storage format, and
`python -m encoder_worker` serves a real job queued by the gateway's `RedisEncoder`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from encoder_worker import EncodedImage, EncoderConfig, EncoderPipeline
from encoder_worker.storage import GROUP, JOBS_STREAM
from gateway.encoders.redis_encoder import RedisEncoder

ROOT = Path(__file__).resolve().parents[2]

# Installed before anything else runs: any import of gateway or gateway.* fails, and is
# remembered, so one swallowed by an `except` still fails the process at exit.
NO_GATEWAY = """
import atexit, importlib.abc, os, sys

class _NoGateway(importlib.abc.MetaPathFinder):
    attempts = []

    def find_spec(self, name, path=None, target=None):
        if name == "gateway" or name.startswith("gateway."):
            self.attempts.append(name)
            raise ImportError(f"{name} is blocked in this process")
        return None

_finder = _NoGateway()
sys.meta_path.insert(0, _finder)
try:
    import gateway
except ImportError:
    _finder.attempts.clear()
else:
    sys.exit("the gateway import block does not work")

def _check():
    if _finder.attempts:
        print(f"gateway imports attempted: {_finder.attempts}", file=sys.stderr, flush=True)
        os._exit(3)

atexit.register(_check)
"""

IMPORT_ALL = """
import importlib, json, pkgutil, sys
import encoder_worker

names = [m.name for m in pkgutil.walk_packages(encoder_worker.__path__, "encoder_worker.")]
for name in names:
    importlib.import_module(name)
import encoder_worker.worker

import torch
from encoder_worker.payload import quantize_tokens
from encoder_worker.storage import pack_encoded, read_redis_value, redis_value, unpack_encoded
from encoder_worker.types import EncodedImage, ImageLayout

tokens = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
payload = quantize_tokens(tokens, torch.tensor([0, 3, 4, 9, 15]), 16, 32)
image = EncodedImage("d" * 64, "f" * 64, 5, 16, 64, payload, {"vision": 1.5, "batch_size": 2.0},
                     ImageLayout("<image>", (5,)))
entry = pack_encoded(image)
back = unpack_encoded(read_redis_value(redis_value(entry)))
assert back.payload == payload and back.layout == image.layout, back
assert (back.digest, back.fingerprint, back.tokens_kept, back.tokens_total, back.hidden_size,
        back.timings_ms) == ("d" * 64, "f" * 64, 5, 16, 64, {"vision": 1.5, "batch_size": 2.0})
refused = 0
for bad in (b"", b"VGV0" + entry[4:], entry[:-1], entry[:12]):
    try:
        unpack_encoded(bad)
    except ValueError:
        refused += 1
try:
    read_redis_value(redis_value(entry)[:-1])
except ValueError:
    refused += 1
print(json.dumps({"modules": names, "refused": refused,
                  "gateway_loaded": any(m.split(".")[0] == "gateway" for m in sys.modules)}))
"""

RUN_MODULE = """
import runpy
sys.argv = ["encoder_worker", *sys.argv[1:]]
runpy.run_module("encoder_worker", run_name="__main__", alter_sys=True)
"""


def _python(code: str, *args: str, **kw) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VISIONGATE_")}
    return subprocess.Popen(
        [sys.executable, "-c", NO_GATEWAY + code, *args], cwd=ROOT, env=env, **kw
    )


def test_every_module_imports_and_entries_round_trip_without_gateway() -> None:
    proc = _python(IMPORT_ALL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err.decode()[-4000:]
    report = json.loads(out.decode().strip().splitlines()[-1])
    modules = set(report["modules"])
    for name in (
        "encoder_worker.__main__",
        "encoder_worker.batch_commit",
        "encoder_worker.deployment_follower",
        "encoder_worker.jobs",
        "encoder_worker.local_encoder",
        "encoder_worker.pipeline",
        "encoder_worker.process",
        "encoder_worker.spans",
        "encoder_worker.storage",
        "encoder_worker.worker",
        "encoder_worker.families.llava",
    ):
        assert name in modules, sorted(modules)
    assert report["refused"] == 5
    assert report["gateway_loaded"] is False


def test_python_m_encoder_worker_refuses_missing_redis_url_without_gateway() -> None:
    proc = _python(RUN_MODULE, "--device", "cpu", stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err.decode()
    assert "--redis-url (or VISIONGATE_REDIS_URL) is required" in err.decode()


async def test_python_m_encoder_worker_serves_jobs_without_gateway(
    redis_url, tiny_clip_dir, photos, tmp_path
) -> None:
    from redis.asyncio import Redis

    config = EncoderConfig(tower=tiny_clip_dir, device="cpu")
    pipeline = EncoderPipeline(config, 48, None)
    try:
        (expected,) = pipeline.encode_batch([photos["chelsea"]])
    finally:
        pipeline.close()
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        proc = _python(
            RUN_MODULE,
            "--redis-url", redis_url,
            "--vision-tower", tiny_clip_dir,
            "--hidden-size", "48",
            "--target-rms", "none",
            "--device", "cpu",
            "--block-ms", "200",
            "--consumer", "standalone",
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        enc = RedisEncoder(redis_url, config, 48, None, timeout_s=120)
        await enc.start()
        try:
            got = await enc.encode(photos["chelsea"])
        finally:
            await enc.aclose()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log_path.read_text()
    assert code == 0, output[-4000:]
    assert isinstance(got, EncodedImage) and got.fingerprint == expected.fingerprint
    assert got.payload.to_bytes() == expected.payload.to_bytes()
    assert "worker.started" in output and "consumer=standalone" in output
    r = Redis.from_url(redis_url)
    try:  # it stopped cleanly: nothing pending, and it left the group
        assert await r.xlen(JOBS_STREAM) == 0
        assert [c["name"] for c in await r.xinfo_consumers(JOBS_STREAM, GROUP)] == []
    finally:
        await r.aclose()


def test_the_gateway_import_block_holds() -> None:
    """A process that imports gateway fails, and so does one that swallows the ImportError."""
    proc = _python("import gateway.settings\n", stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and b"gateway is blocked in this process" in err, err
    quiet = "try:\n    import gateway.telemetry\nexcept ImportError:\n    pass\n"
    proc = _python(quiet, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3 and b"gateway imports attempted" in err, err
