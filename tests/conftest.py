"""Shared fixtures: a private redis-server (and a private 3-master Redis Cluster) per test
session, free ports, real sample photos, and gateways over the fake engine and encoder
(`fake_gateway`, `make_gateway`; see `gateway.testing.fake_gateway`)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.testing.fake_gateway import FakeGateway, GatewayFactory, start_gateway, unit_settings
from gateway.testing.fakes import FakeEncoder, FakeEngine
from gateway.testing.images import data_url, photo_bytes, unique_photo
from gateway.testing.ports import free_port, wait_for_port

# tests import these from here too; they are defined once, in gateway.testing
__all__ = ("data_url", "free_port", "photo_bytes", "unique_photo", "wait_for_port")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """A real redis-server on a free port, private to this test session; yields its URL."""
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="visiongate-redis-")
    proc = start_redis(port, workdir)
    try:
        wait_for_port(port)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """The session's redis URL, flushed after each test so tests never share state."""
    import redis

    yield redis_server
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()


@pytest.fixture
def raw_redis(redis_url: str):
    """A plain client on the test session's redis-server, to look at or damage stored values."""
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def start_redis(port: int, workdir: str, *extra: str) -> subprocess.Popen:
    """A redis-server on `port` keeping nothing on disk (its files in `workdir`)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server)")
    return subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def sleep_redis(port: int, seconds: float, after_s: float = 0.0) -> threading.Thread:
    """Make the redis-server on `port` (started with `--enable-debug-command yes`) sleep
    `seconds` (`DEBUG SLEEP`) after `after_s`, from a daemon thread; join it to wait it out."""
    import redis

    def run() -> None:
        time.sleep(after_s)
        client = redis.Redis(port=port, socket_timeout=seconds + 10)
        client.execute_command("DEBUG", "SLEEP", str(seconds))
        client.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def redis_cluster(masters: int = 3) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """A real Redis Cluster of `masters` masters on free ports; yields its `redis+cluster://`
    URL naming every master as a seed, and the masters' processes (which a test may stop)."""
    import redis

    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.fail("redis-cli is not installed (apt-get install redis-tools)")
    workdir = tempfile.mkdtemp(prefix="visiongate-cluster-")
    ports = [free_port() for _ in range(masters)]
    procs = []
    try:
        for port in ports:
            node_dir = Path(workdir, str(port))
            node_dir.mkdir()
            procs.append(
                start_redis(
                    port,
                    str(node_dir),
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    "--cluster-port",  # the default, port + 10000, may be taken or past 65535
                    str(free_port()),
                )
            )
        for port in ports:
            wait_for_port(port)
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        deadline = time.monotonic() + 20
        for port in ports:
            node = redis.Redis(port=port)
            while node.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                if time.monotonic() > deadline:
                    pytest.fail(f"Redis Cluster node {port} never reported cluster_state:ok")
                time.sleep(0.1)
            node.close()
        yield "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports), procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_cluster_server() -> Iterator[str]:
    """A real 3-master Redis Cluster, private to this test session; yields its URL."""
    with redis_cluster() as (url, _):
        yield url


@pytest.fixture
def redis_cluster_url(redis_cluster_server: str) -> Iterator[str]:
    """The session's Redis Cluster URL, every master flushed after each test."""
    from encoder_worker.redis_conn import sync_client

    yield redis_cluster_server
    client = sync_client(redis_cluster_server)
    client.flushall(target_nodes="primaries")
    client.close()


@pytest.fixture
def raw_cluster(redis_cluster_url: str):
    """A cluster client on the test session's Redis Cluster, to look at stored values."""
    from encoder_worker.redis_conn import sync_client

    client = sync_client(redis_cluster_url)
    yield client
    client.close()


def tiny_vision_tower(kind: str, path: Path, *, layers: int = 3, seed: int = 0) -> str:
    """Save a small random CLIP or SigLIP vision tower (`kind` "clip" or "siglip": 32 wide, 32 px
    images in 8 px patches, `layers` deep, weights drawn from `seed`) to `path`, as safetensors;
    returns the path. An encoder builds on it in a moment."""
    import torch
    from transformers import (
        CLIPVisionConfig,
        CLIPVisionModel,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    config_cls, model_cls = {
        "clip": (CLIPVisionConfig, CLIPVisionModel),
        "siglip": (SiglipVisionConfig, SiglipVisionModel),
    }[kind]
    torch.manual_seed(seed)
    config = config_cls(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    model_cls(config).eval().save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def astronaut_jpeg() -> bytes:

    return photo_bytes("astronaut")


@pytest.fixture(scope="session")
def chelsea_jpeg() -> bytes:
    return photo_bytes("chelsea")


@pytest.fixture(scope="session")
def tmp_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def fake_gateway() -> Iterator[FakeGateway]:
    """One gateway over FakeEngine / FakeEncoder for the session, ready (/readyz 200). Shared:
    leave its fakes' knobs alone (a test that needs others takes `make_gateway`)."""
    gateway = start_gateway(unit_settings(), FakeEngine(), FakeEncoder())
    yield gateway
    gateway.server.stop()


@pytest.fixture
def make_gateway() -> Iterator[GatewayFactory]:
    """Starts gateways of a test's own: `make_gateway(engine=FakeEngine(delay_s=0.05),
    settings=dict(api_keys=["k"]), wait=False)`; each is stopped after the test."""
    started: list[FakeGateway] = []

    def make(
        *,
        engine: FakeEngine | None = None,
        encoder: FakeEncoder | None = None,
        settings: dict[str, Any] | None = None,
        wait: bool = True,
    ) -> FakeGateway:
        gateway = start_gateway(
            unit_settings(**(settings or {})),
            engine or FakeEngine(),
            encoder or FakeEncoder(),
            wait=wait,
        )
        started.append(gateway)
        return gateway

    yield make
    for gateway in started:
        gateway.server.stop()
