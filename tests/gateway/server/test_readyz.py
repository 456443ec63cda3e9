"""/readyz says what the gateway needs and lacks: the model, its Redis, its encoder workers."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.server.app import create_app
from gateway.server.runner import ServerThread
from tests.conftest import free_port, tiny_vision_tower, wait_for_port
from tests.gateway.conftest import gateway_settings

ROOT = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def private_redis() -> Iterator[tuple[str, subprocess.Popen]]:
    """A redis-server of this test alone, which the test may stop."""
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="visiongate-readyz-")
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
         "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port(port)
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small CLIP vision checkpoint, so the worker's encoder builds in a moment."""
    return tiny_vision_tower("clip", tmp_path_factory.mktemp("readyz-clip"), layers=2)


def readyz_until(http: httpx.Client, done, what: str, limit_s: float = 120.0) -> httpx.Response:
    """Poll /readyz until `done(response)`; each poll must answer within its short timeout."""
    deadline = time.monotonic() + limit_s
    while True:
        r = http.get("/readyz", timeout=5)
        if done(r):
            return r
        assert time.monotonic() < deadline, f"{what} not reached: {r.status_code} {r.text}"
        time.sleep(0.2)


def test_readyz_on_the_plain_default(gateway_server: ServerThread) -> None:
    r = httpx.get(f"{gateway_server.http_url}/readyz", timeout=10)
    assert r.status_code == 200
    assert r.json() == {"status": "ready", "model": "SmolLM2-135M-Instruct"}


@pytest.mark.slow
def test_readyz_names_missing_encoder_workers_and_redis(tiny_clip: str, tmp_path: Path) -> None:
    log_path = tmp_path / "worker.log"
    with private_redis() as (redis_url, redis_proc):
        settings = gateway_settings(encoder="redis", redis_url=redis_url, vision_tower=tiny_clip)
        with (
            ServerThread(create_app(settings), settings) as server,
            httpx.Client(base_url=server.http_url) as http,
        ):
            r = readyz_until(http, lambda r: r.json()["status"] != "loading", "models loaded")
            assert r.status_code == 503, r.text
            assert r.json() == {
                "status": "not_ready",
                "model": "SmolLM2-135M-Instruct",
                "encoder_workers": 0,
                "missing": ["encoder_workers"],
            }

            env = {k: v for k, v in os.environ.items() if not k.startswith("VISIONGATE_")}
            with log_path.open("wb") as log:
                worker = subprocess.Popen(
                    [sys.executable, "-m", "gateway.cli.main", "worker", "--redis-url", redis_url,
                     "--device", "cpu", "--block-ms", "200"],
                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
            try:
                r = readyz_until(http, lambda r: r.status_code == 200, "a live worker")
                assert r.json() == {
                    "status": "ready",
                    "model": "SmolLM2-135M-Instruct",
                    "encoder_workers": 1,
                }
                assert "worker.adopted" in log_path.read_text()  # the tiny tower, from Redis

                redis_proc.send_signal(signal.SIGTERM)
                redis_proc.wait(10)
                r = readyz_until(http, lambda r: r.status_code == 503, "Redis seen down", 30)
                assert r.json() == {
                    "status": "not_ready",
                    "model": "SmolLM2-135M-Instruct",
                    "missing": ["redis", "encoder_workers"],
                }
                for _ in range(5):  # still answered (never hangs on the dead Redis)
                    assert http.get("/readyz", timeout=5).json()["missing"][0] == "redis"
                assert http.get("/healthz").status_code == 200
            finally:
                worker.send_signal(signal.SIGTERM)
                try:
                    worker.wait(30)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait()


@pytest.mark.slow
def test_readyz_on_a_cluster_names_redis_while_a_master_is_down() -> None:
    from tests.conftest import redis_cluster

    with redis_cluster() as (cluster_url, masters):
        settings = gateway_settings(redis_url=cluster_url)
        with (
            ServerThread(create_app(settings), settings) as server,
            httpx.Client(base_url=server.http_url) as http,
        ):
            r = readyz_until(http, lambda r: r.status_code == 200, "ready on the cluster")
            assert r.json() == {"status": "ready", "model": "SmolLM2-135M-Instruct"}
            masters[1].send_signal(signal.SIGTERM)  # a third of the slots has no master now
            masters[1].wait(10)
            r = readyz_until(http, lambda r: r.status_code == 503, "a master seen down", 30)
            assert r.json() == {
                "status": "not_ready",
                "model": "SmolLM2-135M-Instruct",
                "missing": ["redis"],
            }
            assert http.get("/healthz").status_code == 200
