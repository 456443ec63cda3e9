"""The serving base of the three OpenAI HTTP APIs: one answer's steps, written once.

Chat Completions, Responses and the legacy Completions each check their own body and build
their own answer; between the two they run the same template, `OpenAIServing.serve`:

1. prepare (the API's own): its body checked by the request layer, its response options built
   once (a frozen `ResponseOptions`), then
2. admit (`OpenAIServing.admit`, shared): image references resolved (a missing one is refused
   before anything is counted), the API key's rate limit taken (past it, or past a token
   limit's room: `rate_limited`), the request's encode slots taken (fair between keys), its
   inline images put in the vision cache, and then the API's own session step (`build`). Any
   failure from the rate limit on closes the slots again, so a refused request holds none.
   The key's token reservation and its cap on responses in flight (`concurrency_limited`)
   are the chat service's first step (`gateway.chat.metering`), for every API alike;
3. answer or error (`OpenAIServing.answer`): the service's events (`respond`) read until the
   first text or the end (`open_answer`), so that a failure before any output keeps its own
   HTTP status (and `refused` undoes what the turn stored); the encode slots close once the
   images are resolved (or failed), which is before any text;
4. stream or complete: an `EventStream` of the API's SSE frames (`stream`), or its whole answer
   (`complete`).

A subclass fills in `respond`, `stream` and `complete` (and `refused` when its prepare stores
something); what the base reads of its prepared turn is `PreparedTurn`, an immutable value the
API builds once. Serving returns values and raises only `GatewayError` (the route maps both):
an answer that fails before any output is an `ErrorResponse`, one that fails later ends its
stream with an error frame.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import structlog

from gateway.api.http.event_streams import close_shielded, read_ahead, replay
from gateway.api.openai.chat import protocol as p
from gateway.caching.redis_deadline import RedisBudget, open_request_budget
from gateway.chat.events import Finished
from gateway.chat.requests import (
    RequestLimits,
    add_inline_images,
    admit_encodes,
    resolve_references,
)
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.chat.events import ResponseOptions, ServiceEvent
    from gateway.chat.vision_resolver import EncodePermit
    from gateway.server.state import GatewayState

__all__ = (
    "DONE",
    "EventStream",
    "OpenAIServing",
    "Opened",
    "PreparedTurn",
    "failure_of",
    "fingerprint",
    "is_finished",
    "open_answer",
    "open_store_budget",
    "read_to_end",
)

log = structlog.get_logger("visiongate.http")

DONE = b"data: [DONE]\n\n"  # the last frame of every Chat Completions and Completions stream

T = TypeVar("T")
E = TypeVar("E")
Prepared = TypeVar("Prepared", bound="PreparedTurn")
Answer = TypeVar("Answer")  # the API's whole (non-streamed) answer


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


class StreamedOrNot(Protocol):
    """An API's request body: `stream` asks for SSE."""

    @property
    def stream(self) -> bool | None: ...


class PreparedTurn(Protocol):
    """What the serving base reads of an API's prepared turn (each API's frozen dataclass)."""

    @property
    def request(self) -> StreamedOrNot: ...

    @property
    def options(self) -> ResponseOptions: ...

    @property
    def permit(self) -> EncodePermit:
        """The turn's encode slots, taken by `admit`; closed once its images are resolved."""
        ...

    @property
    def session_header(self) -> str | None:
        """The stored session a streamed answer names in `X-Session-Id`; None: none."""
        ...


class OpenAIServing(ABC, Generic[Prepared, Answer]):
    """One OpenAI API's serving object: its `create` runs `serve` over its own prepare."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.limits = RequestLimits.of(state.settings)

    async def serve(
        self, prepare: Callable[[], Awaitable[Prepared]]
    ) -> Answer | EventStream | p.ErrorResponse:
        """The answer to one request: `prepare` (the API's checks, ending in `admit`), then
        `answer`; a refusal on the way is its `ErrorResponse`."""
        received = time.perf_counter()
        budget = open_store_budget(self.state)
        try:
            prepared = await prepare()
        except GatewayError as exc:
            return p.error_response(exc)
        return await self.answer(prepared, received, budget)

    async def admit(
        self,
        *,
        owner: str,
        inline: Mapping[str, bytes],
        refs: Mapping[str, str],
        build: Callable[[], Awaitable[T]],
    ) -> tuple[EncodePermit, T]:
        """Admit one turn of `owner`'s (the steps in this module's docstring: `inline` maps the
        digests of the images it sent to their bytes, `refs` those it references to the param
        that names them) and run `build`, the API's session step, inside its encode slots. The
        permit comes back open: the answer closes it (`open_answer`); on any failure here it is
        closed before the error goes on."""
        state = self.state
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

    async def answer(
        self, prepared: Prepared, received: float, budget: RedisBudget
    ) -> Answer | EventStream | p.ErrorResponse:
        """The service's answer to an admitted turn: its error when it fails before any output
        (the turn `refused`), else its stream or its whole answer."""
        events = self.respond(prepared, received)
        opened = await open_answer(events, prepared.options.cancel, prepared.permit)
        if isinstance(opened, GatewayError):
            await self.refused(prepared)
            return p.error_response(opened)
        if prepared.request.stream:
            return EventStream(self.stream(prepared, opened, budget), prepared.session_header)
        return await self.complete(prepared, opened)

    @abstractmethod
    def respond(self, prepared: Prepared, received: float) -> AsyncIterator[ServiceEvent]:
        """The chat service's events for the turn (`received`: when its request came in)."""

    async def refused(self, prepared: Prepared) -> None:
        """The turn failed before any output: undo what its prepare stored. Nothing, here."""

    @abstractmethod
    def stream(
        self, prepared: Prepared, opened: Opened[ServiceEvent], budget: RedisBudget
    ) -> AsyncIterator[bytes]:
        """The SSE frames of the opened answer; `budget` is its request's (`use_request_budget`:
        the frames are sent from another task)."""

    @abstractmethod
    async def complete(
        self, prepared: Prepared, opened: Opened[ServiceEvent]
    ) -> Answer | p.ErrorResponse:
        """The whole answer, once the opened one ended."""


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


async def read_to_end(
    opened: Opened[E], cancel: threading.Event, take: Callable[[E], object]
) -> Finished | None:
    """Read the opened answer to its end for a whole (non-streamed) answer: `take` gets every
    event but the `Finished`, which is returned (None: the answer ended without one). The
    answer is closed on the way out, and cancelled if it has not finished."""
    finished: Finished | None = None
    try:
        async for event in replay(opened.first, opened.events, is_finished):
            if isinstance(event, Finished):
                finished = event
            else:
                take(event)
    finally:
        cancel.set()  # no-op once finished; frees the engine otherwise
        await close_shielded(opened.events)
    return finished


def is_finished(event: object) -> bool:
    return isinstance(event, Finished)


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
