"""Serving `POST /v1/chat/completions`: check, join the session, run the service, answer.

The serving layer returns values, never raises for a bad request: a `ChatCompletion`, an
`EventStream` of SSE frames, or an `ErrorResponse` that the route maps to its HTTP status.
A streamed answer is started before the HTTP status is chosen: the first text (or the failure)
decides between `200 text/event-stream` and an error with its proper code. A client that
disconnects cancels generation, which frees the engine at once: mid-stream, and while a
non-streamed answer is computed (the router watches the ASGI channel for it). The
request's values are checked by the request layer (`gateway.chat.requests`, and
`gateway.chat.output_grammar` for tools and response formats), as the WebSocket's are.

How an answer is shown (content, tool calls, chunks) is `chunks`; `n` answers are choices
0..n-1; `logprobs` go with the content. The steps every OpenAI API shares (admitting the turn,
opening its answer, streaming or completing it) are the serving base's
(`gateway.api.openai.serving`); this fills them in.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import msgspec
import structlog

from gateway.api.http.event_streams import close_shielded
from gateway.api.openai.chat import protocol as p
from gateway.api.openai.chat.chunks import (
    Frames,
    StreamedAnswer,
    choice_of,
    finish_reason_of,
    usage_of,
)
from gateway.api.openai.chat.messages import Conversation, all_parts, parse_messages, reconcile
from gateway.api.openai.serving import (
    DONE,
    EventStream,
    OpenAIServing,
    Opened,
    failure_of,
    fingerprint,
    is_finished,
    read_to_end,
)
from gateway.caching.redis_deadline import RedisBudget, use_request_budget
from gateway.chat.events import Finished, ResponseOptions, TextChunk
from gateway.chat.output_grammar import (
    apply_tool_plan,
    plan_tools,
    response_format_grammar,
    tools_from_chat,
)
from gateway.chat.requests import (
    RequestLimits,
    check_cache_salt,
    check_choices,
    check_image_count,
    check_item_count,
    check_logprobs,
    check_model,
    check_session_id,
    fetch_remote,
    refuse_unsupported,
    response_options,
)
from gateway.protocol.errors import GatewayError
from gateway.sessions.session import Session

if TYPE_CHECKING:
    from gateway.chat.events import ServiceEvent
    from gateway.chat.vision_resolver import EncodePermit
    from gateway.engine.interface import TokenLogprob

__all__ = ("ChatCompletionServing",)

log = structlog.get_logger("visiongate.http")

_json = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class _Prepared:
    session: Session
    stored: bool  # the session lives in the store (a session_id was given)
    options: ResponseOptions
    conversation: Conversation
    request: p.ChatCompletionRequest
    created: int
    model: str
    permit: EncodePermit  # the request's encode slots, held until its images are resolved
    added: tuple[str, ...] = ()  # items appended to the stored session

    @property
    def completion_id(self) -> str:
        return self.options.client_id or self.options.response_id

    @property
    def session_header(self) -> str | None:
        return self.session.id if self.stored else None


@dataclass(frozen=True, slots=True)
class _Joined:
    """The session step's result: the session to answer from and what it stored."""

    session: Session
    added: tuple[str, ...] = ()  # ids of the items this turn appended to a stored session
    load_ns: tuple[int, int] | None = None  # when the stored session was loaded (epoch ns)


class ChatCompletionServing(OpenAIServing[_Prepared, p.ChatCompletion]):
    async def create(
        self, request: p.ChatCompletionRequest, *, owner: str, session_id: str | None
    ) -> p.ChatCompletion | EventStream | p.ErrorResponse:
        """The answer to `request` from `owner`'s key; `session_id` (the header's) joins a
        session, as the body's `session_id` does."""
        return await self.serve(
            lambda: self.prepare(request, owner, session_id or request.session_id)
        )

    # ------------------------------------------------------------ preparing

    async def prepare(
        self, request: p.ChatCompletionRequest, owner: str, session_id: str | None
    ) -> _Prepared:
        state, limits = self.state, self.limits
        state.require()  # the one "busy" answer while the model loads
        model = state.engine.model_id
        check_model(request.model, model)
        options = _options(request, limits)
        check_item_count(len(request.messages), limits, "messages")
        fetched = await fetch_remote(all_parts(request.messages), limits, param="messages")
        conv = parse_messages(request.messages, limits, fetched)
        permit, joined = await self.admit(
            owner=owner,
            inline=conv.inline,
            refs=conv.refs,
            build=lambda: self._join(owner, session_id, conv),
        )
        stored = session_id is not None
        options = replace(
            options,
            store=stored,  # a throwaway session: the vision cache still applies by content
            session_load_ns=joined.load_ns,
            # the id the client gets names the response in its trace too
            client_id=f"chatcmpl-{secrets.token_hex(12)}",
        )
        return _Prepared(
            session=joined.session,
            stored=stored,
            options=options,
            conversation=conv,
            request=request,
            created=int(time.time()),
            model=model,
            permit=permit,
            added=joined.added,
        )

    async def _join(self, owner: str, session_id: str | None, conv: Conversation) -> _Joined:
        """The session the turn answers from: a throwaway one, or the stored `session_id`
        brought in line with the request's messages."""
        state, settings, limits = self.state, self.state.settings, self.limits
        if session_id is None:
            session = Session.new(
                owner,
                instructions=settings.default_instructions,
                max_output_tokens=settings.max_output_tokens,
            )
            reconcile(session, conv, settings.default_instructions)
            return _Joined(session)
        check_session_id(session_id)
        load_start = time.time_ns()
        await self._load_or_create(session_id, owner)
        added: list[str] = []

        def bring_in_line(stored: Session) -> int:
            kept = reconcile(stored, conv, settings.default_instructions)
            check_image_count(stored.image_digests, limits, "messages")
            added[:] = [item.id for item in stored.items[kept:]]
            return kept

        # compare-and-set: a concurrent request on the same session is never overwritten
        session, kept = await state.sessions.update(session_id, owner, bring_in_line)
        load_ns = (load_start, time.time_ns())
        log.info(
            "http_session_turn",
            session_id=session.id,
            kept_items=kept,
            items=len(session.items),
        )
        return _Joined(session, tuple(added), load_ns)

    async def refused(self, prepared: _Prepared) -> None:
        """A turn that failed before any output (refused by the key's token limits, an image
        that did not encode, the engine's refusal) leaves its stored session without the
        messages it appended, as a failed Responses turn leaves its chain."""
        if not prepared.stored or not prepared.added:
            return
        added = set(prepared.added)

        def drop(stored: Session) -> None:
            while stored.items and stored.items[-1].id in added:
                stored.items.pop()

        session = prepared.session
        try:
            await self.state.sessions.update(session.id, session.owner, drop)
        except GatewayError as exc:
            log.warning("http_roll_back_failed", session_id=session.id, code=exc.code)

    async def _load_or_create(self, session_id: str, owner: str) -> Session:
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

    def respond(self, prepared: _Prepared, received: float) -> AsyncIterator[ServiceEvent]:
        return self.state.require().service.respond(
            prepared.session, prepared.options, received_at=received
        )

    async def complete(
        self, prepared: _Prepared, opened: Opened[ServiceEvent]
    ) -> p.ChatCompletion | p.ErrorResponse:
        logprobs: dict[int, list[TokenLogprob]] = {}

        def take(ev: ServiceEvent) -> None:
            if isinstance(ev, TextChunk):
                logprobs.setdefault(ev.index, []).extend(ev.logprobs)

        finished = await read_to_end(opened, prepared.options.cancel, take)
        if finished is None or finished.status == "failed":
            return p.error_response(failure_of(finished))
        ext = self._extension(finished, prepared)
        return p.ChatCompletion(
            id=prepared.completion_id,
            created=prepared.created,
            model=prepared.model,
            choices=[
                choice_of(end, [*logprobs.get(end.index, ()), *end.logprobs], prepared.options)
                for end in finished.answers()
            ],
            usage=usage_of(finished, ext),
            system_fingerprint=fingerprint(self.state),
            visiongate=ext,
        )

    async def stream(
        self, prepared: _Prepared, opened: Opened[ServiceEvent], budget: RedisBudget
    ) -> AsyncIterator[bytes]:
        use_request_budget(budget)  # the answer is still this request's: so is its bound
        options, events = prepared.options, opened.events
        include_usage = bool(
            prepared.request.stream_options and prepared.request.stream_options.include_usage
        )
        answers = [StreamedAnswer(options, i) for i in range(options.n)]
        frame = Frames(
            prepared.completion_id,
            prepared.created,
            prepared.model,
            fingerprint(self.state),
            include_usage,
        )
        finished: Finished | None = None

        def frames_of(ev: ServiceEvent) -> list[bytes]:
            nonlocal finished
            if isinstance(ev, TextChunk):
                answer = answers[ev.index]
                if answer.plain:
                    return [frame.text(ev.index, ev.text)] if ev.text else []
                answer.logprobs.extend(ev.logprobs)
                return [
                    frame(ev.index, delta, logprobs=answer.take_logprobs())
                    for delta in answer.feed(ev.text)
                ]
            if isinstance(ev, Finished):
                finished = ev
            return []

        try:
            for i in range(options.n):  # every choice announced first, in order
                yield frame(i, p.Delta(role="assistant", content=""))
            # the events read ahead, then the rest unless they ended it (`replay`, written out:
            # no generator between the service's and this one)
            for ev in opened.first:
                for data in frames_of(ev):
                    yield data
            if opened.first and not is_finished(opened.first[-1]):
                async for ev in events:
                    if type(ev) is TextChunk and answers[ev.index].plain:
                        if ev.text:  # most frames: the text as it came, nothing else
                            yield frame.text(ev.index, ev.text)
                        continue
                    for data in frames_of(ev):
                        yield data
            if finished is None or finished.status == "failed":
                yield b"data: " + _json.encode(p.error_response(failure_of(finished))) + b"\n\n"
            else:
                ext = self._extension(finished, prepared)
                for end in finished.answers():
                    answer = answers[end.index]
                    for delta in answer.finish():
                        yield frame(end.index, delta, logprobs=answer.take_logprobs())
                    answer.logprobs.extend(end.logprobs)
                    yield frame(
                        end.index,
                        p.Delta(),
                        finish_reason=finish_reason_of(end, answer.calls > 0),
                        logprobs=answer.take_logprobs() if answer.logprobs else None,
                        extension=ext,
                    )
                if include_usage:
                    yield frame.usage(usage_of(finished, ext))
            yield DONE
        finally:
            # reached on completion and on a client disconnect (the stream is cancelled)
            prepared.options.cancel.set()
            if finished is None:
                log.info("http_stream_abandoned", completion_id=prepared.completion_id)
            await close_shielded(events)

    def _extension(self, ev: Finished, prepared: _Prepared) -> p.CompletionExtension:
        return p.CompletionExtension(
            timings=p.Timings.of(ev),
            cache=p.CacheReport.of(ev),
            image_tokens=ev.image_tokens,
            image_tokens_total=ev.image_tokens_total,
            session_id=prepared.session.id if prepared.stored else None,
            truncated_items=ev.truncated_items,
            stored=True if prepared.stored else None,  # a failed answer has no extension
        )


def _options(request: p.ChatCompletionRequest, limits: RequestLimits) -> ResponseOptions:
    """The request's response values, checked by the request layer (HTTP names the params)."""
    refuse_unsupported(
        request.functions,
        "functions",
        "functions is the legacy form of tools and is not supported; send tools",
    )
    refuse_unsupported(
        request.function_call,
        "function_call",
        "function_call is the legacy form of tool_choice and is not supported; send tool_choice",
    )
    if request.stream_options is not None and not request.stream:
        raise GatewayError(
            "invalid_request",
            "stream_options is only allowed when stream is true",
            param="stream_options",
        )
    max_tokens, param = request.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, param = request.max_tokens, "max_tokens"
    options = response_options(
        limits,
        max_tokens=max_tokens,
        max_tokens_param=param,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=request.stop,
        truncation=request.truncation,
        api="chat_completions",
    )
    checked = replace(
        options,
        n=check_choices(request.n),
        logprobs=check_logprobs(request.logprobs, request.top_logprobs),
        cache_salt=check_cache_salt(request.cache_salt),
    )
    # JSON answers are bounded to fit the answer's tokens, so that they close (output_grammar)
    budget = options.max_output_tokens or limits.max_output_tokens
    text_grammar = response_format_grammar(request.response_format, budget=budget)
    plan = plan_tools(
        tools_from_chat(request.tools),
        request.tool_choice,
        request.parallel_tool_calls,
        text_grammar=text_grammar,
        budget=budget,
    )
    return apply_tool_plan(
        checked,
        plan,
        text_grammar=text_grammar,
        tool_results=any(m.role == "tool" for m in request.messages),
    )
