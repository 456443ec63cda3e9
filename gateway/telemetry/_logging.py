"""structlog configuration: JSON lines (console rendering on a TTY) with trace ids on each line.

Standard-library loggers (uvicorn, litestar, redis) are routed through the same processors, so
every line the process writes has the same shape and carries ``trace_id``/``span_id`` whenever
an OTel span is current.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any, TextIO

import structlog
import structlog.tracebacks
from opentelemetry import trace

__all__ = ("add_trace_ids", "configure_logging", "log_response")

_ACCESS_LOGGER = "visiongate.access"


def add_trace_ids(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: add the current span's ``trace_id``/``span_id`` (hex) if any."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    return event


def configure_logging(
    level: str = "info", json: bool | None = None, *, stream: TextIO | None = None
) -> None:
    """Configure structlog and the root logger. ``json=None`` picks JSON unless ``stream``
    (stderr by default) is a TTY. Calling it again replaces the previous configuration."""
    stream = sys.stderr if stream is None else stream
    if json is None:
        json = not (hasattr(stream, "isatty") and stream.isatty())
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}")

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_trace_ids,
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=bool(getattr(stream, "isatty", lambda: False)()))
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            # tracebacks without local variables: locals can hold API keys and image bytes
            *([structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False))] if json else []),
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_visiongate", False)]:
        root.removeHandler(old)
    handler._visiongate = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(numeric)

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )


def log_response(
    *,
    api: str,
    model: str,
    status: str,
    session_id: str | None,
    response_id: str,
    timings_ms: Mapping[str, float],
    usage: Mapping[str, int],
    **extra: Any,
) -> None:
    """The one access line per response: ``event="response"`` on logger ``visiongate.access``
    with each timing as ``<name>_ms`` and each usage count as a field. Call it while the
    response's span is current so the line carries its trace id."""
    fields: dict[str, Any] = {
        "api": api,
        "model": model,
        "status": status,
        "session_id": session_id,
        "response_id": response_id,
    }
    for name, ms in timings_ms.items():
        fields[name if name.endswith("_ms") else f"{name}_ms"] = round(float(ms), 3)
    fields.update(usage)
    fields.update(extra)
    structlog.get_logger(_ACCESS_LOGGER).info("response", **fields)
