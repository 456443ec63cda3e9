"""Litestar's OpenTelemetry plugin wired to one `Telemetry`'s providers.

HTTP requests get one server span each. Per-message ``receive``/``send`` spans (every SSE chunk,
every WebSocket frame) are left out, and the realtime WebSocket route, ``/metrics`` and the health
probes get no ASGI span at all: a realtime response is traced by its own ``chat <model>`` span.

Spans hold no client text of unbounded size and no secrets: a span is named for its route
template (``GET /v1/sessions/{session_id}``, not the path the client sent), query values
are redacted from the recorded URL (a key sent as ``?api_key=`` is refused but would still be
recorded), and the URL and user agent are clipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gateway.protocol.errors import clip

if TYPE_CHECKING:
    from litestar.plugins.opentelemetry import OpenTelemetryPlugin
    from litestar.types import Scope
    from opentelemetry.trace import Span

    from gateway.telemetry._telemetry import Telemetry

__all__ = ("EXCLUDED_PATHS", "litestar_plugin", "redact_url", "span_details")

EXCLUDED_PATHS: tuple[str, ...] = ("/v1/realtime", "/metrics", "/healthz", "/readyz", "/health")
MAX_ATTRIBUTE_CHARS = 200
REDACTED = "[redacted]"
# request attributes the ASGI instrumentation copies from the client (old and new conventions)
_URL_ATTRIBUTES = ("http.url", "url.full", "http.target")
_QUERY_ATTRIBUTES = ("url.query",)
_CLIPPED_ATTRIBUTES = ("url.path", "http.user_agent", "user_agent.original", "http.server_name")


def redact_query(query: str) -> str:
    """``a=1&api_key=k`` -> ``a=[redacted]&api_key=[redacted]``: the names stay, no value does
    (clipped to a bounded length)."""
    parts = []
    for pair in query.split("&"):
        name, eq, value = pair.partition("=")
        parts.append(f"{name}={REDACTED}" if eq and value else pair)
    return clip("&".join(parts), MAX_ATTRIBUTE_CHARS)


def redact_url(url: str) -> str:
    """A URL (or path) with its query values redacted and each half clipped."""
    base, question, query = url.partition("?")
    base = clip(base.partition("#")[0], MAX_ATTRIBUTE_CHARS)
    return f"{base}?{redact_query(query)}" if question else base


def _route_template(scope: Scope) -> str | None:
    """The template of the route `scope` will be routed to (the plugin's middleware runs before
    routing, so the router is asked here), or None when no route matches."""
    from litestar.utils import normalize_path

    router = getattr(scope.get("litestar_app"), "asgi_router", None)
    if router is None:
        return None
    path = scope.get("path", "")
    if root_path := scope.get("root_path", ""):
        path = path.split(root_path, maxsplit=1)[-1]
    try:
        return router.handle_routing(path=normalize_path(path), method=scope.get("method"))[4]
    except Exception:  # not found, method not allowed: the span is named for the method alone
        return None


def span_details(scope: Scope) -> tuple[str, dict[str, Any]]:
    """Span name and route for a request: the matched route template (``GET
    /v1/sessions/{session_id}``), never the raw path; the method alone when none matches."""
    method = str(scope.get("method", "")).strip() or "HTTP"
    route = _route_template(scope)
    if route is None:
        return method, {}
    return f"{method} {route}", {"http.route": route}


def _scrub_request_span(span: Span, _: Scope) -> None:
    """Overwrite the URL attributes the instrumentation recorded with redacted, clipped ones."""
    attributes = getattr(span, "attributes", None)
    if not attributes or not span.is_recording():
        return
    for name in (*_URL_ATTRIBUTES, *_QUERY_ATTRIBUTES, *_CLIPPED_ATTRIBUTES):
        value = attributes.get(name)
        if not isinstance(value, str):
            continue
        if name in _URL_ATTRIBUTES:
            span.set_attribute(name, redact_url(value))
        elif name in _QUERY_ATTRIBUTES:
            span.set_attribute(name, redact_query(value))
        else:
            span.set_attribute(name, clip(value, MAX_ATTRIBUTE_CHARS))


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
        scope_span_details_extractor=span_details,
        server_request_hook_handler=_scrub_request_span,
    )
    return OpenTelemetryPlugin(config)
