"""A real gateway (real SmolLM2 engine, real encoder) on a loopback port, shared by the tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from gateway.app import create_app
from gateway.server import ServerThread
from gateway.settings import Settings

MiB = 1024 * 1024


def gateway_settings(**overrides) -> Settings:
    base = dict(max_output_tokens=24, max_image_bytes=2 * MiB, max_pixels=4_000_000,
                engine_max_queue=8, cache_dir=os.environ.get("VISIONGATE_CACHE_DIR"))
    base.update(overrides)
    return Settings.load(base, environ={})


@pytest.fixture(scope="session")
def gateway_server() -> Iterator[ServerThread]:
    """One in-process gateway for the whole test session (the models load once)."""
    settings = gateway_settings()
    with ServerThread(create_app(settings), settings) as server:
        server.wait_ready()
        yield server


@pytest.fixture(scope="session")
def ws_url(gateway_server: ServerThread) -> str:
    return gateway_server.ws_url


def gateway_state(server: ServerThread):
    return server.app.state["gateway"]


@pytest.fixture(scope="module")
def uncached_server() -> Iterator[ServerThread]:
    """A gateway that keeps nothing between turns: no vision cache, no KV reuse (the stateless
    baseline answers must match)."""
    settings = gateway_settings(vision_cache_bytes=0, kv_budget_bytes=0)
    with ServerThread(create_app(settings), settings) as server:
        server.wait_ready()
        yield server
