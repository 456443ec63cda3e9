"""structlog output: JSON lines carrying the current span's ids, from structlog and stdlib
loggers alike."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from gateway.telemetry import Telemetry, configure_logging, log_response


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    buf = io.StringIO()
    configure_logging("info", json=None, stream=buf)  # StringIO is not a TTY -> JSON
    yield buf
    configure_logging("warning", json=True)


def lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def test_json_lines_carry_trace_ids(telemetry: Telemetry, stream: io.StringIO) -> None:
    log = structlog.get_logger("visiongate.test")
    log.info("outside")
    with telemetry.tracer.start_as_current_span("chat smol") as span:
        log.info("inside", n=1)
        logging.getLogger("uvicorn.error").warning("from stdlib %s", "logger")
        log_response(
            api="realtime",
            model="smol",
            status="completed",
            session_id="s1",
            response_id="r1",
            timings_ms={
                "queue": 1.0,
                "encode": 80.5,
                "prefill": 20.0,
                "ttft": 130.25,
                "total": 900.0,
            },
            usage={"input_tokens": 30, "output_tokens": 12, "cached_tokens": 20},
        )
    log.debug("filtered out at info")
    out = lines(stream)
    assert [o["event"] for o in out] == ["outside", "inside", "from stdlib logger", "response"]
    assert "trace_id" not in out[0]
    ctx = span.get_span_context()
    for o in out[1:]:
        assert o["trace_id"] == format(ctx.trace_id, "032x")
        assert o["span_id"] == format(ctx.span_id, "016x")
        assert o["timestamp"].endswith("Z") and o["level"] in ("info", "warning")
    assert out[2]["logger"] == "uvicorn.error"
    access = out[3]
    assert access["logger"] == "visiongate.access"
    assert access["ttft_ms"] == 130.25 and access["total_ms"] == 900.0
    assert access["output_tokens"] == 12 and access["session_id"] == "s1"


def test_console_renderer_when_asked(stream: io.StringIO) -> None:
    buf = io.StringIO()
    configure_logging("info", json=False, stream=buf)
    structlog.get_logger("x").info("hello", k="v")
    text = buf.getvalue()
    assert "hello" in text and "k" in text and not text.lstrip().startswith("{")


def test_unknown_level_rejected() -> None:
    with pytest.raises(ValueError, match="level"):
        configure_logging("loud")


# strings that hold a secret in each form the patterns know, and near misses that hold none
_SECRET_SHAPES = [
    "Authorization: Bearer sk-live-123",
    "bEaReR abc.def",
    "Basic dXNlcjpwYXNzd29yZA==",
    "GET /v1/realtime?model=m&api_key=sk-1 HTTP/1.1",
    "/v1/realtime?token=abc#frag",
    "openai-insecure-api-key.sk-live-9, realtime",
    "session vgk-" + "A" * 43,
    "glued-ek_" + "b" * 43,
    "ek_abcdef",
    "(vgk-abc_def)",
]
_NEAR_MISSES = [
    "",
    "completed",
    "visiongate/smollm2-135m",
    "resp_0123456789abcdef",
    "bearer",
    "basic short",
    "?model=m&key_id=1",
    "xek_abcdefgh",
    "vgk-abc",
    "2026-12-07T15:11:33.123456Z",
]


@pytest.mark.parametrize("text", _SECRET_SHAPES + _NEAR_MISSES)
def test_one_search_decides_whether_a_string_is_scrubbed(text: str) -> None:
    """The combined pattern finds something exactly where one of the secret patterns does, so a
    string it passes over would have come out of every substitution unchanged."""
    from gateway.telemetry._logging import _ANY_SECRET, _SECRET_PATTERNS, _scrub_text

    any_pattern = any(p.search(text) for p, _ in _SECRET_PATTERNS)
    assert (_ANY_SECRET.search(text) is not None) == any_pattern
    assert any_pattern == (text in _SECRET_SHAPES)
    if any_pattern:
        assert "[redacted]" in _scrub_text(text)
    else:
        assert _scrub_text(text) == text
