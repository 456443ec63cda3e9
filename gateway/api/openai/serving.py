"""What the three OpenAI HTTP APIs serve alike: admitting a turn, opening its answer, its end.

Chat Completions, Responses and the legacy Completions each check their own body and build
their own answer; between the two they run the same steps, written here once:

- `admit_turn`: image references resolved (a missing one is refused before anything is
  counted), the API key's rate limit taken, the request's encode slots taken (fair between
  keys), its inline images put in the vision cache, and then the API's own session step
  (`build`). Any failure from the rate limit on closes the slots again, so a refused request
  holds none.
- `open_answer`: the service's events read until the first text or the end, so that a failure
  before any output keeps its own HTTP status; the encode slots close once the images are
  resolved (or failed), which is before any text.
- `failure_of`: the error a failed or empty end stands for.
- `open_store_budget`: the request's bound on waiting for Redis (`store_timeout_s`).

They return values and raise only `GatewayError` (the route maps both): an answer that fails
before any output is an `ErrorResponse`, one that fails later ends its stream with an error
frame. A stream is an `EventStream` of ready SSE frames.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import structlog

from gateway.api.http.event_streams import close_shielded, read_ahead
from gateway.caching.redis_deadline import RedisBudget, open_request_budget
from gateway.chat.events import Finished
from gateway.chat.requests import add_inline_images, admit_encodes, resolve_references
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.chat.events import ServiceEvent
    from gateway.chat.vision_resolver import EncodePermit
    from gateway.server.state import GatewayState

__all__ = (
    "DONE",
    "EventStream",
    "Opened",
    "admit_turn",
    "failure_of",
    "fingerprint",
    "open_answer",
    "open_store_budget",
)

log = structlog.get_logger("visiongate.http")

DONE = b"data: [DONE]\n\n"  # the last frame of every Chat Completions and Completions stream

T = TypeVar("T")
E = TypeVar("E")


@dataclass(slots=True)
class EventStream:
    """SSE frames of one streamed answer, ready to send; `session_id` goes in a header."""

    frames: AsyncIterator[bytes]
    session_id: str | None


@dataclass(slots=True)
class Opened(Generic[E]):
    """An answer that got as far as its first text (or a good end): the events read ahead,
    then the rest of the stream (`replay` hands on both)."""

    first: list[E]
    events: AsyncIterator[E]


async def admit_turn(
    state: GatewayState,
    *,
    owner: str,
    inline: Mapping[str, bytes],
    refs: Mapping[str, str],
    build: Callable[[], Awaitable[T]],
) -> tuple[EncodePermit, T]:
    """Admit one turn of `owner`'s (the steps in this module's docstring: `inline` maps the
    digests of the images it sent to their bytes, `refs` those it references to the param that
    names them) and run `build`, the
    API's session step, inside its encode slots. The permit comes back open: the answer closes
    it (`open_answer`); on any failure here it is closed before the error goes on."""
    vision = state.require().vision
    await resolve_references(refs, vision, owner=owner)
    await state.rate_limiter.acquire(owner)
    permit = await admit_encodes([*inline, *refs], vision, owner=owner)
    try:
        await add_inline_images(inline, vision, owner=owner)
        return permit, await build()
    except BaseException:
        permit.close()
        raise


async def open_answer(
    events: AsyncIterator[ServiceEvent],
    cancel: threading.Event,
    permit: EncodePermit | None = None,
) -> Opened[ServiceEvent] | GatewayError:
    """Read `events` to the first text or the end. A failure (or an end with no event at all)
    closes the stream and comes back as its error; otherwise the answer goes on from here."""
    try:
        first = await read_ahead(events, cancel)
    finally:
        if permit is not None:
            permit.close()  # the images are resolved (or failed) before any text
    end = first[-1] if first else None
    if end is None or (isinstance(end, Finished) and end.status == "failed"):
        await close_shielded(events)
        return failure_of(end)
    return Opened(first, events)


def open_store_budget(state: GatewayState) -> RedisBudget:
    """Bound the time this request waits for Redis, all its calls together (`store_timeout_s`;
    `gateway.caching.redis_deadline`); its streamed body takes the budget along
    (`use_request_budget`)."""
    return open_request_budget(state.settings.store_timeout_s)


def failure_of(end: object) -> GatewayError:
    """The error a response's end stands for: its own, or an engine error when it ended with
    no result (no `Finished`, or a failed one that names no error)."""
    if isinstance(end, Finished) and end.error is not None:
        return end.error
    return GatewayError("engine_error", "the engine ended without a result")


def fingerprint(state: GatewayState) -> str:
    """`system_fingerprint`: names the vision pipeline the answers' images went through."""
    return "fp_" + state.require().vision.fingerprint[:12]
