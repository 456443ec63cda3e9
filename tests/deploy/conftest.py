"""Fixtures for deploy/ checks: Debian's prometheus and promtool, which `make system-deps`
installs; a test never installs them itself."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"


def _ensure(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} is not installed: `make system-deps` installs Debian's prometheus")
    return path


@pytest.fixture(scope="session")
def promtool() -> str:
    return _ensure("promtool")


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    return _ensure("prometheus")
