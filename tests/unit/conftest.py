"""Fast tests: the real gateway (Litestar, uvicorn, stores, codecs) over `gateway.testing.fakes`'
engine
and encoder, so nothing loads a model and the whole directory runs in seconds.

Every test collected here is marked `unit` (`pytest -m unit tests/unit`). `fake_gateway` is one
server for the session; `make_gateway` starts servers with their own settings or fake knobs
(a slow engine, a busy one, a small context, a model that is still loading).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gateway.server.app import create_app
from gateway.server.runner import ServerThread
from gateway.settings import Settings
from gateway.testing.fakes import FakeEncoder, FakeEngine

if TYPE_CHECKING:
    from gateway.server.state import GatewayState

UNIT_DIR = Path(__file__).resolve().parent
MiB = 1024 * 1024


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if UNIT_DIR in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.unit)


async def eventually(condition: Callable[[], bool]) -> None:
    """Wait until `condition()` holds (work the event loop still has to run); fail after 10
    seconds, which only a hang reaches."""
    async with asyncio.timeout(10):
        while True:
            if condition():
                return
            await asyncio.sleep(0.01)


def unit_settings(**overrides: Any) -> Settings:
    """Settings for a fast gateway: small limits, nothing read from the environment."""
    base: dict[str, Any] = dict(
        max_output_tokens=32, max_image_bytes=2 * MiB, max_pixels=4_000_000, engine_max_queue=8
    )
    base.update(overrides)
    return Settings.load(base, environ={})


class FakeGateway:
    """A running gateway over fakes: its server, and the fakes to inspect or adjust."""

    def __init__(
        self, server: ServerThread, engine: FakeEngine, encoder: FakeEncoder, settings: Settings
    ) -> None:
        self.server = server
        self.engine = engine
        self.encoder = encoder
        self.settings = settings

    @property
    def http_url(self) -> str:
        return self.server.http_url

    @property
    def ws_url(self) -> str:
        return self.server.ws_url

    @property
    def state(self) -> GatewayState:
        return self.server.app.state["gateway"]


def start_gateway(
    settings: Settings, engine: FakeEngine, encoder: FakeEncoder, *, wait: bool = True
) -> FakeGateway:
    server = ServerThread(create_app(settings, engine=engine, encoder=encoder), settings).start()
    if wait:
        try:
            server.wait_ready(timeout=30)
        except BaseException:
            server.stop()
            raise
    return FakeGateway(server, engine, encoder, settings)


GatewayFactory = Callable[..., FakeGateway]


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
