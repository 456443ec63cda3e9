"""Serving `POST /v1/chat/completions`: check, join the session, run the service, answer.

The serving layer returns values, never raises for a bad request: a `ChatCompletion`, an
`EventStream` of SSE frames, or an `ErrorResponse` that the route maps to its HTTP status.
A streamed answer is started before the HTTP status is chosen: the first text (or the failure)
decides between `200 text/event-stream` and an error with its proper code. A client that
disconnects mid-stream cancels generation, which frees the engine at once. The request's
values are checked by the request layer (`gateway.chat_requests`), as the WebSocket's are.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import msgspec
import structlog

from gateway.chat_events import Finished, ResponseOptions, TextChunk
from gateway.chat_requests import (
    RequestLimits,
    add_inline_images,
    admit_encodes,
    check_image_count,
    check_item_count,
    check_session_id,
    fetch_remote,
    refuse_unsupported,
    resolve_references,
    response_options,
)
from gateway.http import protocol as p
from gateway.http.messages import Conversation, all_parts, parse_messages, reconcile
from gateway.protocol.errors import GatewayError
from gateway.sessions.session import Session

if TYPE_CHECKING:
    from gateway.chat_events import ServiceEvent
    from gateway.state import GatewayState
    from gateway.vision_resolver import EncodePermit

__all__ = ("ChatCompletionServing", "EventStream")

log = structlog.get_logger("visiongate.http")

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class EventStream:
    """SSE frames of one streamed completion, ready to send."""

    frames: AsyncIterator[bytes]
    session_id: str | None


@dataclass(slots=True)
class _Prepared:
    session: Session
    stored: bool  # the session lives in the store (a session_id was given)
    options: ResponseOptions
    conversation: Conversation
    request: p.ChatCompletionRequest
    completion_id: str
    created: int
    model: str
    permit: EncodePermit  # the request's encode slots, held until its images are resolved


class ChatCompletionServing:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.limits = RequestLimits.of(state.settings)

    async def create(
        self, request: p.ChatCompletionRequest, *, owner: str, session_id: str | None
    ) -> p.ChatCompletion | EventStream | p.ErrorResponse:
        received = time.perf_counter()
        try:
            prepared = await self._prepare(request, owner, session_id or request.session_id)
        except GatewayError as exc:
            return p.error_response(exc)
        first: list[ServiceEvent] = []
        try:
            events = self.state.require().service.respond(
                prepared.session, prepared.options, received_at=received
            )
            try:
                # run until the first text or the end, so a failure still gets its HTTP status
                while not first or not isinstance(first[-1], (TextChunk, Finished)):
                    first.append(await events.__anext__())
            except StopAsyncIteration:
                pass
            except BaseException:
                prepared.options.cancel.set()
                await _close(events)
                raise
        finally:
            prepared.permit.close()  # the images are resolved (or failed) before any text
        end = first[-1] if first else None
        if end is None or (isinstance(end, Finished) and end.status == "failed"):
            await _close(events)
            error = (
                end.error
                if isinstance(end, Finished) and end.error
                else GatewayError("engine_error", "the engine ended without a result")
            )
            self._finished(end, prepared)
            return p.error_response(error)
        if request.stream:
            return EventStream(
                self._sse(prepared, first, events), prepared.session.id if prepared.stored else None
            )
        return await self._complete(prepared, first, events)

    # ------------------------------------------------------------ preparing

    async def _prepare(
        self, request: p.ChatCompletionRequest, owner: str, session_id: str | None
    ) -> _Prepared:
        state, limits = self.state, self.limits
        vision = state.require().vision
        model = state.engine.model_id
        if request.model != model:
            raise GatewayError(
                "model_not_found",
                f"the model {request.model!r} does not exist; this gateway serves {model!r}",
                param="model",
            )
        options = _options(request, limits)
        check_item_count(len(request.messages), limits, "messages")
        fetched = await fetch_remote(all_parts(request.messages), limits, param="messages")
        conv = parse_messages(request.messages, limits, fetched)
        await resolve_references(conv.refs, vision, owner=owner)
        await state.rate_limiter.acquire(owner)
        # slots for the encodes this request needs, taken before anything of it is stored
        permit = await admit_encodes([*conv.inline, *conv.refs], vision, owner=owner)
        try:
            return await self._prepare_session(
                request, owner, session_id, options, conv, model, permit
            )
        except BaseException:
            permit.close()
            raise

    async def _prepare_session(
        self,
        request: p.ChatCompletionRequest,
        owner: str,
        session_id: str | None,
        options: ResponseOptions,
        conv: Conversation,
        model: str,
        permit: EncodePermit,
    ) -> _Prepared:
        state, settings, limits = self.state, self.state.settings, self.limits
        await add_inline_images(conv.inline, state.require().vision, owner=owner)

        stored = session_id is not None
        if session_id is None:
            session = Session.new(
                owner,
                instructions=settings.default_instructions,
                max_output_tokens=settings.max_output_tokens,
            )
            options.store = False  # a throwaway session: the vision cache still applies by content
            reconcile(session, conv, settings.default_instructions)
        else:
            check_session_id(session_id)
            load_start = time.time_ns()
            await self._session(session_id, owner)  # load, or create under this id

            def bring_in_line(stored: Session) -> int:
                kept = reconcile(stored, conv, settings.default_instructions)
                check_image_count(stored.image_digests, limits, "messages")
                return kept

            # compare-and-set: a concurrent request on the same session is never overwritten
            session, kept = await state.sessions.update(session_id, owner, bring_in_line)
            options.session_load_ns = (load_start, time.time_ns())
            log.info(
                "http_session_turn",
                session_id=session.id,
                kept_items=kept,
                items=len(session.items),
            )
        return _Prepared(
            session=session,
            stored=stored,
            options=options,
            conversation=conv,
            request=request,
            completion_id=f"chatcmpl-{secrets.token_hex(12)}",
            created=int(time.time()),
            model=model,
            permit=permit,
        )

    async def _session(self, session_id: str, owner: str) -> Session:
        try:
            return await self.state.sessions.load(session_id, owner)
        except GatewayError as exc:
            if exc.code != "session_not_found":
                raise
        settings = self.state.settings
        session = Session.new(
            owner,
            instructions=settings.default_instructions,
            max_output_tokens=settings.max_output_tokens,
            session_id=session_id,
        )
        if not await self.state.sessions.create(session):
            raise GatewayError(
                "session_not_found",
                f"no session {session_id!r} for this API key",
                param="session_id",
            )
        log.info("session_created", session_id=session_id, api="http")
        return session

    # ------------------------------------------------------------ answering

    async def _complete(
        self, prepared: _Prepared, first: list[ServiceEvent], events: AsyncIterator[ServiceEvent]
    ) -> p.ChatCompletion | p.ErrorResponse:
        text: list[str] = []
        finished: Finished | None = None
        try:
            async for ev in _chain(first, events):
                if isinstance(ev, TextChunk):
                    text.append(ev.text)
                elif isinstance(ev, Finished):
                    finished = ev
        finally:
            prepared.options.cancel.set()  # no-op once finished; frees the engine otherwise
            await _close(events)
        self._finished(finished, prepared)
        if finished is None or finished.status == "failed":
            error = (
                finished.error
                if finished and finished.error
                else GatewayError("engine_error", "the engine ended without a result")
            )
            return p.error_response(error)
        ext = self._extension(finished, prepared)
        return p.ChatCompletion(
            id=prepared.completion_id,
            created=prepared.created,
            model=prepared.model,
            choices=[
                p.Choice(
                    index=0,
                    message=p.ChatMessage(content=finished.text),
                    finish_reason=_finish_reason(finished),
                )
            ],
            usage=_usage(finished, ext),
            system_fingerprint=self._fingerprint(),
            visiongate=ext,
        )

    async def _sse(
        self, prepared: _Prepared, first: list[ServiceEvent], events: AsyncIterator[ServiceEvent]
    ) -> AsyncIterator[bytes]:
        include_usage = bool(
            prepared.request.stream_options and prepared.request.stream_options.include_usage
        )
        finished: Finished | None = None
        try:
            yield self._frame(p.Delta(role="assistant", content=""), prepared)
            async for ev in _chain(first, events):
                if isinstance(ev, TextChunk):
                    yield self._frame(p.Delta(content=ev.text), prepared)
                elif isinstance(ev, Finished):
                    finished = ev
            if finished is None or finished.status == "failed":
                error = (
                    finished.error
                    if finished and finished.error
                    else GatewayError("engine_error", "the engine ended without a result")
                )
                yield b"data: " + _json.encode(p.error_response(error)) + b"\n\n"
            else:
                ext = self._extension(finished, prepared)
                yield self._frame(
                    p.Delta(), prepared, finish_reason=_finish_reason(finished), extension=ext
                )
                if include_usage:
                    yield (
                        b"data: "
                        + _json.encode(
                            p.ChatCompletionChunk(
                                id=prepared.completion_id,
                                created=prepared.created,
                                model=prepared.model,
                                choices=[],
                                system_fingerprint=self._fingerprint(),
                                usage=_usage(finished, ext),
                            )
                        )
                        + b"\n\n"
                    )
            yield DONE
        finally:
            # reached on completion and on a client disconnect (the stream is cancelled)
            prepared.options.cancel.set()
            if finished is None:
                log.info("http_stream_abandoned", completion_id=prepared.completion_id)
            await _close(events)
            self._finished(finished, prepared)

    def _frame(
        self,
        delta: p.Delta,
        prepared: _Prepared,
        *,
        finish_reason: str | None = None,
        extension: p.CompletionExtension | None = None,
    ) -> bytes:
        chunk = p.ChatCompletionChunk(
            id=prepared.completion_id,
            created=prepared.created,
            model=prepared.model,
            choices=[p.ChunkChoice(index=0, delta=delta, finish_reason=finish_reason)],
            system_fingerprint=self._fingerprint(),
            visiongate=extension,
        )
        return b"data: " + _json.encode(chunk) + b"\n\n"

    def _fingerprint(self) -> str:
        return "fp_" + self.state.require().vision.fingerprint[:12]

    def _extension(self, ev: Finished, prepared: _Prepared) -> p.CompletionExtension:
        return p.CompletionExtension(
            timings=p.Timings.of(ev),
            cache=p.CacheReport.of(ev),
            image_tokens=ev.image_tokens,
            image_tokens_total=ev.image_tokens_total,
            session_id=prepared.session.id if prepared.stored else None,
            truncated_items=ev.truncated_items,
            stored=(ev.store_error is None) if prepared.stored else None,
        )

    def _finished(self, ev: ServiceEvent | None, prepared: _Prepared) -> None:
        if isinstance(ev, Finished) and ev.status != "failed":
            log.info(
                "http_completion",
                completion_id=prepared.completion_id,
                status=ev.status,
                session_id=prepared.session.id if prepared.stored else None,
                cached_tokens=ev.cached_tokens,
                vision=ev.vision,
            )


def _options(request: p.ChatCompletionRequest, limits: RequestLimits) -> ResponseOptions:
    """The request's response values, checked by the request layer (HTTP names the params)."""
    if request.n is not None and request.n != 1:
        raise GatewayError("invalid_request", "only n=1 is supported", param="n")
    refuse_unsupported(request.tools, "tools", "tools are not supported")
    if request.stream_options is not None and not request.stream:
        raise GatewayError(
            "invalid_request",
            "stream_options is only allowed when stream is true",
            param="stream_options",
        )
    max_tokens, param = request.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, param = request.max_tokens, "max_tokens"
    return response_options(
        limits,
        max_tokens=max_tokens,
        max_tokens_param=param,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=request.stop,
        truncation=request.truncation,
        api="http",
    )


def _finish_reason(ev: Finished) -> str:
    return "length" if ev.status == "incomplete" else "stop"


def _usage(ev: Finished, ext: p.CompletionExtension) -> p.Usage:
    return p.Usage(
        prompt_tokens=ev.input_tokens,
        completion_tokens=ev.output_tokens,
        total_tokens=ev.input_tokens + ev.output_tokens,
        prompt_tokens_details=p.PromptTokensDetails(
            cached_tokens=ev.cached_tokens, image_tokens=ev.image_tokens
        ),
        visiongate=ext,
    )


async def _chain(
    first: list[ServiceEvent], rest: AsyncIterator[ServiceEvent]
) -> AsyncIterator[ServiceEvent]:
    for ev in first:
        yield ev
    if not isinstance(first[-1], Finished):
        async for ev in rest:
            yield ev


async def _close(events: AsyncIterator[ServiceEvent]) -> None:
    # shielded: on a client disconnect the surrounding scope is already cancelled, and closing
    # the service's iterator is what returns the engine's slot
    with anyio.CancelScope(shield=True):
        await events.aclose()  # type: ignore[attr-defined]
