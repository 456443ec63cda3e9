"""Fixtures for deploy/ checks: Debian's prometheus and promtool, installed on demand."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"


def _ensure(binary: str) -> str:
    path = shutil.which(binary)
    if path is not None:
        return path
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        pytest.fail(
            f"{binary} is not installed and cannot be installed here "
            "(needs root and apt-get: apt-get install -y prometheus)"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in ([apt, "update", "-qq"], [apt, "install", "-y", "-qq", "prometheus"]):
        done = subprocess.run(
            cmd, check=False, capture_output=True, text=True, env=env, timeout=600
        )
        if done.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    path = shutil.which(binary)
    if path is None:
        pytest.fail(f"apt-get install prometheus did not provide {binary}")
    return path


@pytest.fixture(scope="session")
def promtool() -> str:
    return _ensure("promtool")


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    return _ensure("prometheus")
