"""Engine requests for tests and benchmarks that drive an `Engine` directly: one user message of
text, with sampling parameters and a prefix-cache salt, and reading its answer to the end.

`text_request` builds one; `text_requests` gives a file its own builder (its request-id prefix,
default answer length and salt), so two test files never share KV blocks by accident. Request
ids are `<prefix>-<monotonic ns>`, unique within a process, unless the caller names one.
`drain` runs a request to the end and returns what the engine yielded, sorted by kind.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gateway.engine.interface import (
    Engine,
    GenerationRequest,
    GenerationResult,
    Message,
    SamplingParams,
    TextDelta,
)

__all__ = ("TextRequestBuilder", "drain", "text_request", "text_requests")


TextRequestBuilder = Callable[..., GenerationRequest]


def text_request(
    text: str,
    max_tokens: int = 16,
    salt: str | None = None,
    request_id: str = "",
    *,
    prefix: str = "req",
    **sampling: Any,
) -> GenerationRequest:
    """A request asking `text` as the user, for at most `max_tokens` tokens, under the cache
    salt `salt` (None: anonymous); `sampling` goes to `SamplingParams`."""
    return GenerationRequest(
        request_id or f"{prefix}-{time.monotonic_ns()}",
        [Message("user", [text])],
        SamplingParams(max_output_tokens=max_tokens, **sampling),
        cache_salt=salt,
    )


def text_requests(
    prefix: str, *, max_tokens: int = 16, salt: str | None = None
) -> TextRequestBuilder:
    """`text_request` with these defaults: `ask = text_requests("edge", max_tokens=8)`, then
    `ask(QUESTION)`, `ask(QUESTION, 4, "salt-a")` or `ask(QUESTION, seed=3, temperature=0.9)`."""

    def build(
        text: str,
        max_tokens: int = max_tokens,
        salt: str | None = salt,
        request_id: str = "",
        **sampling: Any,
    ) -> GenerationRequest:
        return text_request(text, max_tokens, salt, request_id, prefix=prefix, **sampling)

    return build


async def drain(
    engine: Engine, request: GenerationRequest
) -> tuple[list[TextDelta], list[GenerationResult]]:
    """Run `request` on `engine` to its end: the text deltas and the results (one per choice),
    each in the order they came."""
    deltas: list[TextDelta] = []
    results: list[GenerationResult] = []
    async for item in engine.generate(request):
        if isinstance(item, TextDelta):
            deltas.append(item)
        else:
            results.append(item)
    return deltas, results
