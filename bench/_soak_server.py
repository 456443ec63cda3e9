"""The soak benchmark's gateway: a child process on a free loopback port, real or on fakes.

`SoakGateway` is the load benchmark's `GatewayProcess` (settings through `VISIONGATE_*`, only
those this build has, stopped in order) that can also start `python -m bench._soak_server`:
the same app, server and stores as `visiongate serve`, with gateway/testing/fakes.py's instant
engine and
encoder in place of the models (`--fake`: a quick look at the benchmark's own mechanics).
`SOAK_FAKE_DELAY_S` spaces the fake engine's text deltas (default 0.01 s). API keys are never
logged (`bench._load_server.redacted` replaces them by their count).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from bench._load_server import GatewayProcess

__all__ = ("SoakGateway", "serve_fake")


class SoakGateway(GatewayProcess):
    """The load benchmark's gateway process, or (`fake`) the same app on the fake models."""

    def __init__(
        self, overrides: dict[str, Any], log_path: Path, *, fake: bool, fake_delay_s: float = 0.01
    ) -> None:
        command = ("bench._soak_server",) if fake else ("gateway", "serve")
        super().__init__("soak", overrides, log_path, command=command)
        self.fake = fake
        if fake:
            self.env["SOAK_FAKE_DELAY_S"] = str(fake_delay_s)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


def serve_fake() -> None:
    """The child side of `SoakGateway(fake=True)`: serve the app on the fake engine and
    encoder, configured by `VISIONGATE_*` like `visiongate serve`."""
    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:  # tests/ is not an installed package
        sys.path.insert(0, str(root))
    from gateway.server.app import create_app
    from gateway.server.runner import serve
    from gateway.settings import Settings
    from gateway.testing.fakes import FakeEncoder, FakeEngine

    settings = Settings.load()
    delay_s = float(os.environ.get("SOAK_FAKE_DELAY_S", "0.01"))
    serve(create_app(settings, engine=FakeEngine(delay_s=delay_s), encoder=FakeEncoder()), settings)


if __name__ == "__main__":
    serve_fake()
