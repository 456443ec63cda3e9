"""structlog configuration: JSON lines (console rendering on a TTY) with trace ids on each line.

Standard-library loggers (uvicorn, litestar, redis) are routed through the same processors, so
every line the process writes has the same shape and carries ``trace_id``/``span_id`` whenever
an OTel span is current.

Every line is scrubbed last (`scrub_secrets`): API keys are redacted wherever they show up
(``Bearer <key>``, ``openai-insecure-api-key.<key>``, ``?api_key=<key>``, a field named like
a secret, a managed ``vgk-...`` or ephemeral ``ek_...`` secret anywhere; uvicorn logs the
WebSocket handshake's path and query, and at debug level its headers), and every string is
clipped so a client string of any size stays a short one.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

import structlog
import structlog.tracebacks
from opentelemetry import trace

__all__ = (
    "MAX_LOG_STRING",
    "add_trace_ids",
    "configure_logging",
    "log_response",
    "register_secrets",
    "scrub_secrets",
)

_ACCESS_LOGGER = "visiongate.access"

MAX_LOG_STRING = 500  # characters of one string field (a traceback: of each of its lines)
_MAX_TRACEBACK_LINES = 200
REDACTED = "[redacted]"
# fields whose value is a secret, whatever it holds
_SECRET_FIELDS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "api_key",
        "api-key",
        "apikey",
        "x-api-key",
        "password",
        "secret",
        "token",
        "access_token",
        "cookie",
        "sec-websocket-protocol",
    }
)
_QUERY_SECRETS = "api[_-]?key|key|token|access_token|password|secret|sig|signature"
_SECRET_PATTERNS = (
    # `Authorization: Bearer <key>` / `Basic <credentials>`, as a header line or a value
    (re.compile(r"(?i)\b(bearer\s+)[^\s\"',;]+"), rf"\1{REDACTED}"),
    (re.compile(r"(?i)\b(basic\s+)[A-Za-z0-9+/]{8,}=*"), rf"\1{REDACTED}"),
    # the Realtime API's subprotocol form of a key
    (re.compile(r"(?i)(openai-insecure-api-key\.)[^\s\"',;]+"), rf"\1{REDACTED}"),
    # a key in a query string (refused, but still written in the handshake's log line)
    (re.compile(rf"(?i)([?&;](?:{_QUERY_SECRETS})=)[^&\s\"'#]*"), rf"\1{REDACTED}"),
    # the gateway's own secrets by their form, wherever they are (a session id, a model name, a
    # path, a message): managed keys `vgk-...` and ephemeral Realtime keys `ek_...`, both of
    # URL-safe base64 characters (43 of them): glued to other text, by their full length; on
    # their own, from 6 characters on (a prefix cut short by the clip is still caught)
    (re.compile(r"(vgk-|ek_)[A-Za-z0-9_-]{40,}"), rf"\1{REDACTED}"),
    (re.compile(r"(?<![A-Za-z0-9])(vgk-|ek_)[A-Za-z0-9_-]{6,}"), rf"\1{REDACTED}"),
)


def _any_of(patterns: tuple[tuple[re.Pattern[str], str], ...]) -> re.Pattern[str]:
    """One pattern that finds whatever any of `patterns` finds (each as its own alternative,
    its flags scoped to it): a string it finds nothing in is left as it is by every one."""
    parts = []
    for pattern, _ in patterns:
        text = pattern.pattern
        parts.append(f"(?i:{text[4:]})" if text.startswith("(?i)") else f"(?:{text})")
    return re.compile("|".join(parts))


# most strings of a line hold none: one search instead of a substitution by each pattern
_ANY_SECRET = _any_of(_SECRET_PATTERNS)


def add_trace_ids(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: add the current span's ``trace_id``/``span_id`` (hex) if any."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    return event


# the configured API keys themselves: redacted wherever a client puts one (a session id, a model
# name, a path), not only where the patterns above expect a key
_known_keys: tuple[str, ...] = ()


def register_secrets(keys: Iterable[str]) -> None:
    """Redact these exact strings (the configured API keys) from every line from now on."""
    global _known_keys
    _known_keys = tuple(
        sorted({k for k in (*_known_keys, *keys) if len(k) >= 4}, key=len, reverse=True)
    )


def _scrub_text(text: str, limit: int = MAX_LOG_STRING) -> str:
    # cut first (the patterns never run over megabytes), then redact: a key cut short is still
    # matched by its prefix, and one cut before its prefix is not in the text any more
    size = len(text)
    for key in _known_keys:  # before the cut, so no part of a key is left at the edge
        if key in text:
            text = text.replace(key, REDACTED)
    head = text[:limit]
    if _ANY_SECRET.search(head) is not None:
        for pattern, replacement in _SECRET_PATTERNS:
            head = pattern.sub(replacement, head)
    return head if size <= limit else f"{head}... ({size} chars)"


def _scrub_traceback(text: str) -> str:
    lines = text.split("\n")
    kept = [_scrub_text(line) for line in lines[:_MAX_TRACEBACK_LINES]]
    if len(lines) > _MAX_TRACEBACK_LINES:
        kept.append(f"... ({len(lines) - _MAX_TRACEBACK_LINES} more lines)")
    return "\n".join(kept)


def _scrub_value(value: Any, depth: int = 0) -> Any:
    if isinstance(value, str):
        return _scrub_traceback(value) if "\n" in value else _scrub_text(value)
    if depth > 6:
        return value
    if isinstance(value, dict):
        return {
            k: REDACTED if str(k).lower() in _SECRET_FIELDS and v else _scrub_value(v, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_scrub_value(v, depth + 1) for v in value]
    return value


def scrub_secrets(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    """structlog processor (run last, on every line): redact API keys and clip long strings.

    Fields named like a secret (``authorization``, ``api_key``, ...) are replaced whole; other
    strings have keys in them redacted and are clipped to `MAX_LOG_STRING` characters, a
    multi-line one (a traceback) line by line."""
    for key, value in event.items():
        event[key] = REDACTED if key.lower() in _SECRET_FIELDS and value else _scrub_value(value)
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
    # tracebacks without local variables (locals can hold API keys and image bytes), rendered
    # before the scrub so their text is scrubbed too
    exceptions: Any = (
        structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        )
        if json
        else structlog.processors.format_exc_info
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            exceptions,
            scrub_secrets,
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
    # the HTTP client's line per request (health probes of upstream replicas every 2 s, each
    # request sent upstream) is noise at info; the gateway logs what matters itself
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(max(numeric, logging.WARNING))

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
