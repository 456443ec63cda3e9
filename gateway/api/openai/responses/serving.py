"""Serving the Responses API (`/v1/responses`) over sessions.

A chain of responses is one session, so it gets the vision-cache and KV reuse of a Realtime
session: a response without `previous_response_id` starts a session (owned by the API key); one
with it continues the session of that response. When that session still ends with the previous
response (the usual case) the new input items are appended, under compare-and-set, so the
engine's per-session KV carries over. When it does not (an older response of the chain was
continued, or another continuation of the same response got there first) the conversation up
to the previous response is copied into a new session: the chain forks and neither branch sees
the other's items. `instructions` belong to one response, never to the chain.

`store=false` answers from a throwaway session: nothing of the response is kept, and it cannot
be retrieved or continued. A stored response leaves a record
(`gateway.sessions.response_records`) naming its session and its last item there, which is
what `previous_response_id` and `GET /v1/responses/{id}` find.

It fills in the serving base every OpenAI API shares (`gateway.api.openai.serving`: prepare,
admit, answer or error, stream or complete) and returns values: a `ResponseObject`, an
`EventStream`, or an `ErrorResponse`. A stream starts only at the first text (or the end), so a
failure before any output gets its HTTP status; a failure after it ends the stream with
`response.failed`. A client that disconnects cancels generation.

A stored response is reported as completed (or incomplete) only once its answer is in the
session and its record is written, so that every completed response can be retrieved and
continued. When the store does not take either, a non-streamed response is answered 503 `busy`
(Retry-After; no response id is given) and its chain is left as it was, best-effort; a streamed
one, whose text went out already, ends with `response.failed` carrying that error.

A prewarm (`prompt_cache_options.prewarm`, `prewarm`) stores its input like any response and
warms the conversation's KV instead of answering: a completed response with no output. Every
response in progress is listed in `in_flight`, so that `cancel` (`POST
/v1/responses/{id}/cancel`, and the WebSocket's `response.cancel`) can stop it. A stream's
events are SSE frames, or the WebSocket's messages (`wire`; see `responses.websocket`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from gateway.api.http.event_streams import close_shielded, replay
from gateway.api.openai.chat import protocol as p
from gateway.api.openai.responses import protocol as r
from gateway.api.openai.responses.in_flight import InFlightResponses
from gateway.api.openai.responses.inputs import ParsedInput, convert_items, image_parts, parse_input
from gateway.api.openai.responses.output_builder import OutputBuilder, frame, mark_failed
from gateway.api.openai.responses.prewarm import (
    cache_notes,
    check_prewarm,
    prewarm,
    prewarm_response,
    wants_prewarm,
)
from gateway.api.openai.serving import (
    EventStream,
    OpenAIServing,
    Opened,
    is_finished,
    open_store_budget,
    read_to_end,
)
from gateway.caching.redis_deadline import RedisBudget, use_request_budget
from gateway.chat.events import Finished, TextChunk
from gateway.chat.output_grammar import (
    apply_tool_plan,
    plan_tools,
    text_format_grammar,
    tools_from_responses,
)
from gateway.chat.requests import (
    check_conversation_size,
    check_image_count,
    check_item_count,
    check_logprobs,
    check_model,
    conversation_chars,
    fetch_remote,
    refuse_unsupported,
    response_options,
)
from gateway.protocol.errors import GatewayError
from gateway.sessions.response_records import ResponseRecord
from gateway.sessions.session import Session, StoredItem, new_id

if TYPE_CHECKING:
    from gateway.chat.events import ResponseOptions, ServiceEvent
    from gateway.chat.vision_resolver import EncodePermit
    from gateway.server.state import GatewayState

__all__ = ("ResponsesServing",)

log = structlog.get_logger("visiongate.http")

_json = msgspec.json.Encoder()
LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
MAX_INPUT_ITEMS_PAGE = 100


@dataclass(frozen=True, slots=True)
class Prepared:
    """A response admitted and ready to answer: built once by `prepare`, read-only after."""

    request: r.ResponsesRequest
    owner: str
    options: ResponseOptions
    session: Session
    stored: bool  # the session lives in the store (store is true)
    created: bool  # this response made the session (a new chain or a fork)
    forked: bool
    parsed: ParsedInput
    permit: EncodePermit
    created_at: int
    model: str
    notes: list[str] = field(default_factory=list)
    prewarm: bool = False  # prompt_cache_options.prewarm: warm the cache, generate nothing
    # how each stream event is sent: an SSE frame (HTTP), a text message (WebSocket)
    wire: Callable[[r.ResponseEvent], bytes] = frame

    @property
    def session_header(self) -> str | None:
        return self.session.id if self.stored else None


class ResponsesServing(OpenAIServing[Prepared, r.ResponseObject]):
    def __init__(self, state: GatewayState) -> None:
        super().__init__(state)
        self.in_flight = InFlightResponses()  # what `cancel` finds, on this process

    # ------------------------------------------------------------ create

    async def create(
        self,
        request: r.ResponsesRequest,
        *,
        owner: str,
        wire: Callable[[r.ResponseEvent], bytes] = frame,
    ) -> r.ResponseObject | EventStream | p.ErrorResponse:
        """One response; a stream's events are made bytes by `wire` (SSE frames by default)."""
        return await self.serve(lambda: self.prepare(request, owner, wire))

    async def answer(
        self, prepared: Prepared, received: float, budget: RedisBudget
    ) -> r.ResponseObject | EventStream | p.ErrorResponse:
        if prepared.prewarm:  # the cache warmed instead of an answer
            return await self._prewarm(prepared, received)
        return await super().answer(prepared, received, budget)

    async def prepare(
        self,
        request: r.ResponsesRequest,
        owner: str,
        wire: Callable[[r.ResponseEvent], bytes] = frame,
    ) -> Prepared:
        state, limits = self.state, self.limits
        state.require()  # the one "busy" answer while the model loads
        model = state.engine.model_id
        check_model(request.model, model)
        options, notes = self._options(request)
        previous = None
        if request.previous_response_id is not None:
            previous = await state.responses.get(request.previous_response_id, owner)
            if previous is None or previous.session_id is None:
                raise _unknown_response(request.previous_response_id, "previous_response_id")
        items = convert_items(request.input, limits)
        fetched = await fetch_remote(image_parts(items), limits, param="input")
        parsed = parse_input(items, limits, fetched)
        permit, (session, created, forked) = await self.admit(
            owner=owner,
            inline=parsed.inline,
            refs=parsed.refs,
            build=lambda: self._join_chain(request, owner, parsed, previous),
        )
        log.info(
            "responses_turn",
            response_id=options.response_id,
            session_id=session.id if options.store else None,
            previous_response_id=request.previous_response_id,
            forked=forked,
            items=len(session.items),
        )
        return Prepared(
            request=request,
            owner=owner,
            options=options,
            session=session,
            stored=options.store,
            created=created,
            forked=forked,
            parsed=parsed,
            permit=permit,
            created_at=int(time.time()),
            model=model,
            notes=notes,
            prewarm=wants_prewarm(request),
            wire=wire,
        )

    def _options(self, request: r.ResponsesRequest) -> tuple[ResponseOptions, list[str]]:
        """The request's values checked by the request layer; refusals name the params."""
        for value, param, what in (
            (
                request.conversation,
                "conversation",
                "conversations are not supported; chain responses with previous_response_id",
            ),
            (request.prompt, "prompt", "prompt templates are not supported"),
            (
                request.context_management,
                "context_management",
                "context management is not "
                'supported; truncation "auto" leaves out the oldest turns',
            ),
            (request.moderation, "moderation", "moderation is not supported"),
            (request.max_tool_calls, "max_tool_calls", "max_tool_calls is not supported"),
            (
                request.background_options,
                "background_options",
                "background responses are not supported",
            ),
        ):
            refuse_unsupported(value, param, what, allow_empty=False)
        check_prewarm(request, self.state.engine)
        if request.background:
            raise GatewayError(
                "invalid_request", "background responses are not supported", param="background"
            )
        _check_metadata(request.metadata)
        options = response_options(
            self.limits,
            max_tokens=request.max_output_tokens,
            max_tokens_param="max_output_tokens",
            temperature=request.temperature,
            top_p=request.top_p,
            instructions=request.instructions,
            truncation=request.truncation or "disabled",
            store=bool(request.store is None or request.store),
            api="responses",
        )
        include = request.include or []
        asked = LOGPROBS_INCLUDE in include or request.top_logprobs is not None
        checked = replace(
            options,
            # instructions belong to this response only; without them, the gateway's default
            instructions=self.state.settings.default_instructions
            if request.instructions is None
            else options.instructions,
            item_id=new_id("msg"),
            logprobs=check_logprobs(asked, request.top_logprobs),
        )
        text_format = request.text.format if request.text is not None else None
        # JSON answers are bounded to fit the answer's tokens, so that they close
        budget = options.max_output_tokens or self.limits.max_output_tokens
        grammar = text_format_grammar(text_format, param="text.format", budget=budget)
        specs = tools_from_responses(request.tools, param="tools")
        plan = plan_tools(
            specs,
            request.tool_choice,
            request.parallel_tool_calls,
            text_grammar=grammar,
            param="tool_choice",
            budget=budget,
        )
        options = apply_tool_plan(
            checked, plan, text_grammar=grammar, tool_results=_has_tool_results(request.input)
        )
        notes = cache_notes(request, self.state.settings)
        if request.reasoning and request.reasoning.get("effort") not in (None, "none"):
            notes.append("reasoning is ignored: the served model does not reason")
        ignored = [i for i in include if i != LOGPROBS_INCLUDE]
        if ignored:
            notes.append(f"include values ignored (nothing to include): {', '.join(ignored)}")
        return options, notes

    async def _join_chain(
        self,
        request: r.ResponsesRequest,
        owner: str,
        parsed: ParsedInput,
        previous: ResponseRecord | None,
    ) -> tuple[Session, bool, bool]:
        """(the session to answer from, whether this response made it, whether it forked)."""
        sessions, settings = self.state.sessions, self.state.settings
        store = request.store is None or request.store
        fresh = Session.new(
            owner,
            instructions=settings.default_instructions,
            max_output_tokens=settings.max_output_tokens,
        )
        if previous is None:
            fresh.items = list(parsed.items)
            self._check_size(fresh, request)
            if store:
                await self._create(fresh)
            return fresh, store, False
        assert previous.session_id is not None  # checked by the caller
        last = previous.last_item_id

        def continue_chain(stored: Session) -> list[StoredItem] | None:
            if stored.items and stored.items[-1].id == last:
                stored.items.extend(parsed.items)
                self._check_size(stored, request)
                return None
            return list(stored.items)  # not at the end of the chain: fork it

        try:
            if store:
                session, earlier = await sessions.update(previous.session_id, owner, continue_chain)
                if earlier is None:
                    return session, False, False
            else:
                earlier = (await sessions.load(previous.session_id, owner)).items
        except GatewayError as exc:
            if exc.code == "session_not_found":
                raise _unknown_response(
                    previous.id, "previous_response_id", "its conversation has expired"
                ) from None
            raise
        ids = [item.id for item in earlier]
        if last not in ids:
            raise _unknown_response(
                previous.id, "previous_response_id", "its conversation is no longer stored"
            )
        fresh.items = [*earlier[: ids.index(last) + 1], *parsed.items]
        self._check_size(fresh, request)
        if store:
            await self._create(fresh)
            log.info("responses_forked", response_id=previous.id, session_id=fresh.id)
        return fresh, store, store

    def _check_size(self, session: Session, request: r.ResponsesRequest) -> None:
        limits = self.limits
        check_item_count(len(session.items), limits, "input")
        check_image_count(session.image_digests, limits, "input")
        chars = conversation_chars(request.instructions, session.items)
        check_conversation_size(chars, limits, "input")

    async def _create(self, session: Session) -> None:
        if not await self.state.sessions.create(session):  # an id of 80 random bits was taken
            raise GatewayError("internal_error", "could not create the conversation's session")

    async def _roll_back(self, prepared: Prepared) -> None:
        """A response that failed before any output, or whose answer or record was not stored,
        leaves its chain as it found it (best-effort: the store may still be down, and then
        continuing from the previous response forks the chain)."""
        if not prepared.stored:
            return
        sessions, session = self.state.sessions, prepared.session
        try:
            if prepared.created:
                await sessions.delete(session.id, prepared.owner)
                return
            added = {item.id for item in prepared.parsed.items} | {prepared.options.item_id}

            def drop(stored: Session) -> None:
                while stored.items and stored.items[-1].id in added:
                    stored.items.pop()

            await sessions.update(session.id, prepared.owner, drop)
        except GatewayError as exc:
            log.warning("responses_roll_back_failed", session_id=session.id, code=exc.code)

    async def refused(self, prepared: Prepared) -> None:
        self.in_flight.end(prepared.options.response_id)
        await self._roll_back(prepared)

    # ------------------------------------------------------------ answering

    def respond(self, prepared: Prepared, received: float) -> AsyncIterator[ServiceEvent]:
        """The service's events, the response listed in flight (`cancel` finds it) until its
        answer ends."""
        options = prepared.options
        self.in_flight.add(options.response_id, prepared.owner, options.cancel)
        return self.state.require().service.respond(prepared.session, options, received_at=received)

    async def complete(
        self, prepared: Prepared, opened: Opened[ServiceEvent]
    ) -> r.ResponseObject | p.ErrorResponse:
        """The whole response, once its answer and its record are stored; an answer or record
        the store did not take is the store's error (busy, 503), with no response id given."""
        out = OutputBuilder(prepared)

        def take(ev: ServiceEvent) -> None:
            if isinstance(ev, TextChunk):
                out.feed(ev)

        try:
            finished = await read_to_end(opened, prepared.options.cancel, take)
        finally:
            self.in_flight.end(prepared.options.response_id)
        response = out.finish(finished)
        if finished is not None and finished.error is not None and _unstored(finished.error):
            await self._roll_back(prepared)
            return p.error_response(finished.error)
        error = await self._record(prepared, response, finished)
        if error is not None:
            await self._roll_back(prepared)
            return p.error_response(error)
        return response

    async def stream(
        self, prepared: Prepared, opened: Opened[ServiceEvent], budget: RedisBudget
    ) -> AsyncIterator[bytes]:
        use_request_budget(budget)  # the answer is still this request's: so is its bound
        events = opened.events
        out = OutputBuilder(prepared)
        wire = prepared.wire
        finished: Finished | None = None
        try:
            yield wire(r.ResponseCreated(sequence_number=out.next(), response=out.snapshot()))
            yield wire(r.ResponseInProgress(sequence_number=out.next(), response=out.snapshot()))
            async for ev in replay(opened.first, events, is_finished):
                if isinstance(ev, TextChunk):
                    out.feed(ev)
                elif isinstance(ev, Finished):
                    finished = ev
                for ready in out.take(wire):
                    yield ready
            response = out.finish(finished)
            error = await self._record(prepared, response, finished)
            if error is not None:  # its text went out, but it cannot be retrieved or continued
                mark_failed(response, error)
            end = {
                "completed": r.ResponseCompleted,
                "failed": r.ResponseFailed,
            }.get(response.status, r.ResponseIncomplete)
            for ready in out.take(wire):
                yield ready
            yield wire(end(sequence_number=out.next(), response=response))
        finally:
            # reached on completion and on a client disconnect (the stream is cancelled)
            prepared.options.cancel.set()
            if finished is None:
                log.info("responses_stream_abandoned", response_id=prepared.options.response_id)
            await close_shielded(events)
            self.in_flight.end(prepared.options.response_id)

    async def _prewarm(
        self, prepared: Prepared, received: float
    ) -> r.ResponseObject | EventStream | p.ErrorResponse:
        """A prewarm (`prewarm`): the cache warmed, then the response, with no output, once its
        record is stored; streamed as created, in progress and completed."""
        try:
            try:
                result, images, encode_ms = await prewarm(
                    self.state.require().service, prepared, prepared.owner
                )
            finally:
                prepared.permit.close()
        except GatewayError as exc:
            await self._roll_back(prepared)
            return p.error_response(exc)
        out = OutputBuilder(prepared)
        total_ms = (time.perf_counter() - received) * 1000
        response = prewarm_response(out.snapshot(), prepared, result, images, encode_ms, total_ms)
        items = prepared.session.items
        error = await self._record(
            prepared, response, None, last_item=items[-1].id if items else None
        )
        if error is not None:
            await self._roll_back(prepared)
            return p.error_response(error)
        if not prepared.request.stream:
            return response

        async def events() -> AsyncIterator[bytes]:
            wire, started = prepared.wire, out.snapshot()
            yield wire(r.ResponseCreated(sequence_number=out.next(), response=started))
            yield wire(r.ResponseInProgress(sequence_number=out.next(), response=started))
            yield wire(r.ResponseCompleted(sequence_number=out.next(), response=response))

        return EventStream(events(), prepared.session.id)

    async def cancel(self, response_id: str, owner: str) -> bytes | p.ErrorResponse:
        """Cancel `owner`'s response that this process is answering now (streamed or not, over
        HTTP or WebSocket) and return it as stored once it ended; a response that is not in
        flight here cannot be cancelled (`response_not_found`, or `invalid_request` when it
        has ended already)."""
        if not await self.in_flight.cancel(response_id, owner):
            try:
                await self._stored(response_id, owner)
            except GatewayError as exc:
                return p.error_response(exc)
            return p.error_response(
                GatewayError(
                    "invalid_request",
                    "the response has ended; only a response in progress can be cancelled",
                    param="response_id",
                )
            )
        log.info("response_cancelled", response_id=response_id)
        return await self.retrieve(response_id, owner)

    async def _record(
        self,
        prepared: Prepared,
        response: r.ResponseObject,
        finished: Finished | None,
        *,
        last_item: str | None = None,
    ) -> GatewayError | None:
        """Keep a stored response's record, so that it can be retrieved and continued; the
        store's error (busy) when a response that did not fail could not be recorded: it must
        then not be reported as completed. `last_item`: a prewarm's, the last item it stored
        (it has no answer)."""
        if not prepared.stored:
            return None
        answered = (finished is not None and finished.status != "failed") or prepared.prewarm
        if prepared.prewarm:
            last = last_item
        elif answered:
            last = prepared.options.item_id
        else:
            last = prepared.parsed.items[-1].id if prepared.parsed.items else None
        record = ResponseRecord(
            id=response.id,
            owner=prepared.owner,
            created_at=float(prepared.created_at),
            body=_json.encode(response),
            session_id=prepared.session.id,
            last_item_id=last,
            input_items=_json.encode(prepared.parsed.views),
        )
        try:
            await self.state.responses.put(record)
        except GatewayError as exc:
            log.error("response_not_recorded", response_id=response.id, code=exc.code)
            if not answered:  # reported as failed already
                return None
            return GatewayError(
                "busy", f"the response could not be stored ({exc.message}); retry it"
            )
        return None

    # ------------------------------------------------------------ stored responses

    async def _stored(self, response_id: str, owner: str) -> ResponseRecord:
        """`owner`'s stored response `response_id`, read within this request's store bound;
        `response_not_found` when there is none."""
        open_store_budget(self.state)
        record = await self.state.responses.get(response_id, owner)
        if record is None:
            raise _unknown_response(response_id, "response_id")
        return record

    async def retrieve(self, response_id: str, owner: str) -> bytes | p.ErrorResponse:
        try:
            record = await self._stored(response_id, owner)
        except GatewayError as exc:
            return p.error_response(exc)
        return record.body

    async def delete(self, response_id: str, owner: str) -> r.ResponseDeleted | p.ErrorResponse:
        open_store_budget(self.state)
        try:
            deleted = await self.state.responses.delete(response_id, owner)
        except GatewayError as exc:
            return p.error_response(exc)
        if not deleted:
            return p.error_response(_unknown_response(response_id, "response_id"))
        log.info("response_deleted", response_id=response_id)
        return r.ResponseDeleted(id=response_id)

    async def input_items(
        self, response_id: str, owner: str, *, after: str | None, limit: int, order: str
    ) -> r.InputItemList | p.ErrorResponse:
        try:
            if not 1 <= limit <= MAX_INPUT_ITEMS_PAGE:
                raise GatewayError(
                    "invalid_request", f"limit must be 1..{MAX_INPUT_ITEMS_PAGE}", param="limit"
                )
            if order not in ("asc", "desc"):
                raise GatewayError(
                    "invalid_request", 'order must be "asc" or "desc"', param="order"
                )
            record = await self._stored(response_id, owner)
        except GatewayError as exc:
            return p.error_response(exc)
        items: list[dict[str, Any]] = msgspec.json.decode(record.input_items)
        if order == "desc":
            items.reverse()
        start = 0
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                return p.error_response(
                    GatewayError("invalid_request", "after names no input item", param="after")
                )
            start = ids.index(after) + 1
        page = items[start : start + limit]
        return r.InputItemList(
            data=page,
            first_id=page[0]["id"] if page else None,
            last_id=page[-1]["id"] if page else None,
            has_more=start + len(page) < len(items),
        )


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise GatewayError(
            "invalid_request",
            f"metadata holds at most {MAX_METADATA_KEYS} keys",
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise GatewayError(
                "invalid_request",
                f"metadata keys hold at most {MAX_METADATA_KEY_CHARS} characters",
                param="metadata",
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise GatewayError(
                "invalid_request",
                f"metadata values hold at most {MAX_METADATA_VALUE_CHARS} characters",
                param=f"metadata.{key}",
            )


def _has_tool_results(value: str | list) -> bool:
    return isinstance(value, list) and any(
        isinstance(item, dict) and item.get("type") == "function_call_output" for item in value
    )


def _unknown_response(response_id: str, param: str, why: str = "") -> GatewayError:
    """An unknown response: 404 where the path names it, 400 where `previous_response_id`
    does (a bad value of the request, as OpenAI answers it)."""
    detail = f" ({why})" if why else ""
    return GatewayError(
        "previous_response_not_found" if param == "previous_response_id" else "response_not_found",
        f"no response {response_id!r} for this API key{detail}",
        param=param,
    )


def _unstored(error: GatewayError) -> bool:
    """A failure of the store (the answer not written), not of the answer itself."""
    return error.code in ("busy", "session_not_found")
