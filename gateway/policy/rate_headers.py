"""The OpenAI rate-limit headers on HTTP answers, and the values behind them.

`RateLimitHeaders` wraps the ASGI app: each HTTP request gets a fresh `RateLimitNote` in a
context variable, which the admission code fills as it decides (`note_requests` by the request
limiter, `note_tokens` by the token limiter: the last value noted wins), and the wrapped `send`
adds what was noted to the response's start, a 429 included:

  x-ratelimit-limit-requests / -remaining-requests / -reset-requests
  x-ratelimit-limit-tokens / -remaining-tokens / -reset-tokens

as OpenAI sends them: counts, and resets as durations ("1s", "6m0s", "20ms"). A request whose
key has no limit of a kind gets none of that kind's headers; one that never reached admission
(a 401, `/v1/models`) gets none. Only the headers' values come from here, never a key.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

__all__ = (
    "Allowance",
    "RateLimitHeaders",
    "RateLimitNote",
    "duration",
    "note_requests",
    "note_tokens",
)


class Allowance(msgspec.Struct, frozen=True):
    """One limit as the headers tell it: the limit, what is left of it, and the seconds until
    it is whole again."""

    limit: int
    remaining: int
    reset_s: float


class RateLimitNote:
    """What admission found for the request in progress."""

    __slots__ = ("requests", "tokens")

    def __init__(self) -> None:
        self.requests: Allowance | None = None
        self.tokens: Allowance | None = None

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = []
        for kind, allowance in (("requests", self.requests), ("tokens", self.tokens)):
            if allowance is None:
                continue
            out += [
                (f"x-ratelimit-limit-{kind}".encode(), str(allowance.limit).encode()),
                (f"x-ratelimit-remaining-{kind}".encode(), str(allowance.remaining).encode()),
                (f"x-ratelimit-reset-{kind}".encode(), duration(allowance.reset_s).encode()),
            ]
        return out


_note: contextvars.ContextVar[RateLimitNote | None] = contextvars.ContextVar(
    "visiongate_rate_limit_note", default=None
)


def note_requests(allowance: Allowance | None) -> None:
    note = _note.get()
    if note is not None and allowance is not None:
        note.requests = allowance


def note_tokens(allowance: Allowance | None) -> None:
    note = _note.get()
    if note is not None and allowance is not None:
        note.tokens = allowance


def duration(seconds: float) -> str:
    """A reset as OpenAI writes it (Go's duration format): "20ms", "1s", "1.5s", "6m0s",
    "1h2m3s". Rounded up to the millisecond, so a reset never reads as sooner than it is."""
    ms = max(math.ceil(seconds * 1000), 0)
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


class RateLimitHeaders:
    __slots__ = ("app",)

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        note = RateLimitNote()
        token = _note.set(note)

        async def send_with_limits(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                extra = note.headers()
                if extra:
                    message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_limits)
        finally:
            _note.reset(token)
