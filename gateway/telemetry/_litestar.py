"""Litestar's OpenTelemetry plugin wired to one `Telemetry`'s providers.

HTTP requests get one server span each. Per-message ``receive``/``send`` spans (every SSE chunk,
every WebSocket frame) are left out, and the realtime WebSocket route, ``/metrics`` and the health
probes get no ASGI span at all: a realtime response is traced by its own ``chat <model>`` span.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from litestar.plugins.opentelemetry import OpenTelemetryPlugin

    from gateway.telemetry._telemetry import Telemetry

__all__ = ("EXCLUDED_PATHS", "litestar_plugin")

EXCLUDED_PATHS: tuple[str, ...] = ("/v1/realtime", "/metrics", "/healthz", "/readyz")


def litestar_plugin(
    telemetry: Telemetry, exclude: Sequence[str] = EXCLUDED_PATHS
) -> OpenTelemetryPlugin:
    """An ``OpenTelemetryPlugin`` using ``telemetry``'s tracer and meter providers."""
    from litestar.plugins.opentelemetry import OpenTelemetryConfig, OpenTelemetryPlugin

    config = OpenTelemetryConfig(
        tracer_provider=telemetry.tracer_provider,
        meter_provider=telemetry.meter_provider,
        exclude=[f"^{path}$" for path in exclude],
        exclude_spans=["receive", "send"],
    )
    return OpenTelemetryPlugin(config)
