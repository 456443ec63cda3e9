"""structlog set-up for the gateway process: JSON lines, or a console renderer on a TTY.

When the telemetry package is present its configuration (which adds trace ids) is used.
"""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ("configure_logging",)


def configure_logging(level: str = "info", *, json: bool | None = None) -> None:
    try:
        from gateway.telemetry import configure_logging as configure_with_traces
    except ImportError:
        configure_with_traces = None
    if configure_with_traces is not None:
        configure_with_traces(level, json=json)
        return
    as_json = (not sys.stderr.isatty()) if json is None else json
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
