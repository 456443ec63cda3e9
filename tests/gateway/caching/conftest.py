"""Fixtures for the cache suites: dead Redis URLs and a Redis server a test may stop and restart."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

from tests.conftest import free_port, start_redis, wait_for_port


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def dead_redis_url() -> str:
    """A Redis URL with nothing listening behind it."""
    return f"redis://127.0.0.1:{free_port()}/0"


class RedisProcess:
    """A redis-server on a fixed port that a test can stop and start again."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.mkdtemp(prefix="visiongate-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = start_redis(self.port, self._dir)
        wait_for_port(self.port)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


@pytest.fixture
def redis_process() -> Iterator[RedisProcess]:
    proc = RedisProcess()
    proc.start()
    try:
        yield proc
    finally:
        proc.cleanup()
