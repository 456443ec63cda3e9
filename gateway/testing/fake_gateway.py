"""A real gateway (Litestar, uvicorn, stores, codecs) over `gateway.testing.fakes`' engine and
encoder, on a loopback port: nothing loads a model, so a test over it runs in milliseconds.

`start_gateway` starts one and waits for `/readyz`; `FakeGateway` holds its server and fakes, to
inspect or adjust, and opens clients on it (`http_client`, `openai_client`: the caller closes
them, `with` does). The tests' `fake_gateway` fixture is one such server for a test session, and
`make_gateway` starts servers with their own settings or fake knobs (a slow engine, a busy one,
a small context, a model that is still loading).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gateway.server.app import create_app
from gateway.server.runner import ServerThread
from gateway.settings import Settings
from gateway.testing.fakes import FakeEncoder, FakeEngine
from gateway.testing.waiting import eventually  # tests import it from here too

__all__ = (
    "CLIENT_TIMEOUT_S",
    "FakeGateway",
    "GatewayFactory",
    "MiB",
    "eventually",
    "start_gateway",
    "unit_settings",
)

if TYPE_CHECKING:
    import httpx
    import openai

    from gateway.server.state import GatewayState

MiB = 1024 * 1024
CLIENT_TIMEOUT_S = 10.0  # a fake answers in milliseconds: only a hang waits this long


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

    def http_client(self, timeout: float = CLIENT_TIMEOUT_S, **kwargs: Any) -> httpx.Client:
        """An `httpx.Client` whose base URL is this gateway."""
        import httpx

        return httpx.Client(base_url=self.http_url, timeout=timeout, **kwargs)

    def openai_client(
        self, timeout: float = CLIENT_TIMEOUT_S, api_key: str = "unused", **kwargs: Any
    ) -> openai.OpenAI:
        """The official `openai` client on this gateway's `/v1`, retries off (a test sees the
        first answer)."""
        import openai

        kwargs.setdefault("max_retries", 0)
        return openai.OpenAI(
            base_url=f"{self.http_url}/v1", api_key=api_key, timeout=timeout, **kwargs
        )


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
