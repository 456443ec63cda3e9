"""A real gateway (Litestar, uvicorn, stores, codecs) over `gateway.testing.fakes`' engine and
encoder, on a loopback port: nothing loads a model, so a test over it runs in milliseconds.

`start_gateway` starts one and waits for `/readyz`; `FakeGateway` holds its server and fakes, to
inspect or adjust, and opens clients on it (`http_client`, `openai_client`: the caller closes
them, `with` does). The tests' `fake_gateway` fixture is one such server for a test session, and
`make_gateway` starts servers with their own settings or fake knobs (a slow engine, a busy one,
a small context, a model that is still loading).

`captured_gateway` runs one with everything it logs (the gateway's own JSON logging, pointed at
a buffer) and every span it finishes kept, for tests of what reaches logs and traces. Logging is
process-wide: it is set back to warnings when the gateway stops.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from gateway.server.app import create_app
from gateway.server.runner import ServerThread
from gateway.settings import Settings
from gateway.testing.fakes import FakeEncoder, FakeEngine
from gateway.testing.waiting import eventually  # tests import it from here too

__all__ = (
    "CLIENT_TIMEOUT_S",
    "CapturedGateway",
    "FakeGateway",
    "GatewayFactory",
    "MiB",
    "captured_gateway",
    "eventually",
    "start_gateway",
    "unit_settings",
)

if TYPE_CHECKING:
    import httpx
    import openai
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

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


class CapturedGateway(FakeGateway):
    """A gateway over fakes whose log lines and finished spans are kept (`captured_gateway`)."""

    def __init__(
        self,
        server: ServerThread,
        engine: FakeEngine,
        encoder: FakeEncoder,
        settings: Settings,
        logs: io.StringIO,
        spans: InMemorySpanExporter,
    ) -> None:
        super().__init__(server, engine, encoder, settings)
        self.logs, self.spans = logs, spans

    def lines(self, **match: Any) -> list[dict[str, Any]]:
        """The JSON log lines so far; with `match`, those whose fields equal it."""
        lines = [json.loads(line) for line in self.logs.getvalue().splitlines() if line.strip()]
        return [line for line in lines if all(line.get(k) == v for k, v in match.items())]

    def finished_spans(self, prefix: str = "") -> list[ReadableSpan]:
        """The spans finished so far whose names start with `prefix`."""
        return [s for s in self.spans.get_finished_spans() if s.name.startswith(prefix)]

    def span_text(self) -> str:
        """Every finished span's name, attributes and event attributes, as one string to search."""
        return " ".join(
            f"{s.name} {json.dumps(dict(s.attributes or {}))} "
            + " ".join(str(e.attributes) for e in s.events)
            for s in self.spans.get_finished_spans()
        )


@contextlib.contextmanager
def captured_gateway(
    settings: Settings,
    *,
    log_level: str = "info",
    ready_timeout: float = 30.0,
    cls: type[CapturedGateway] = CapturedGateway,
) -> Iterator[CapturedGateway]:
    """A ready gateway over fresh fakes logging at `log_level` (JSON) into a buffer and keeping
    its finished spans; `cls` may add a test's own views of them. Stopped, and logging set back
    to warnings, on exit."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gateway.telemetry import configure_logging

    engine, encoder = FakeEngine(), FakeEncoder()
    app = create_app(settings, engine=engine, encoder=encoder)
    logs = io.StringIO()
    configure_logging(log_level, json=True, stream=logs)  # after create_app, which sets its own
    spans = InMemorySpanExporter()
    app.state["gateway"].telemetry.tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    try:
        with ServerThread(app, settings) as server:
            server.wait_ready(timeout=ready_timeout)
            yield cls(server, engine, encoder, settings, logs, spans)
    finally:
        configure_logging("warning", json=True)
