"""Chat serving: one response over a session, independent of the transport.

`ChatService.respond` takes a loaded session and response options, resolves the session's
images to visual tokens (waiting for pre-encodes already under way rather than starting new
ones), asks the engine, and yields transport-neutral events: `Started`, `TextChunk`, then one
`Finished` carrying usage, timings and cache results. The WebSocket and HTTP layers turn those
into their own wire events; neither talks to the engine directly. `respond_raw` does the same
for raw prompts (`/v1/completions`: no session, no chat template), with a `ChoiceEnd` as each
answer ends.

Every response, whichever the entry, is traced and counted once, ends in exactly one
`Finished` (a fault inside ends it as `failed`, never silently), and a consumer that goes away
before the end cancels the engine's work and is recorded as a cancelled response. A stored
response ends as given (completed, incomplete, cancelled) only once its answer is written in
the session: an answer the store did not take ends the response as failed (`busy`, 503), so no
API reports as given what a later turn would not find.

Tools reach the model as text (`gateway.chat.turn_prompt`); an answer given with tools is
stored as its text and tool-call parts, so a client replaying the history with `tool_calls`
matches it. With several answers to one prompt (`n`) every answer streams (`TextChunk.index`)
and ends in `Finished.choices`; only the first is stored. The prompt is fitted to the model's
context by `gateway.chat.context_fit`, the engine read by `gateway.chat.generation_stream`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import structlog

from gateway.chat.answer_place import drop_place, fill_place, take_place
from gateway.chat.context_fit import fit_messages
from gateway.chat.events import (
    Finished,
    ResponseOptions,
    ServiceEvent,
    Started,
    Status,
    TextChunk,
)
from gateway.chat.generation_stream import (
    Ending,
    Generation,
    Guard,
    RawEvent,
    background,
    choice_end,
    ms_since,
    raw_events,
    response_status_of,
)
from gateway.chat.metering import (
    admitted,
    count,
    image_tokens_estimate,
    input_estimate,
    observe,
    output_reservation,
    raw_input_estimate,
    raw_output_reservation,
)
from gateway.chat.response_trace import ResponseTrace
from gateway.chat.session_warmup import warm_up
from gateway.chat.turn_prompt import (
    cache_salt_for,
    kv_key_for,
    sampling_for,
    turn_messages,
)
from gateway.chat.vision_resolver import Resolved, VisionResolver
from gateway.engine.interface import (
    Engine,
    EngineError,
    GenerationRequest,
    WarmUpResult,
)
from gateway.protocol.errors import GatewayError
from gateway.sessions.session import Session, SessionStore, SessionUsage
from gateway.telemetry import NoopTelemetry, Telemetry

if TYPE_CHECKING:
    from gateway.policy.key_usage import TokenMeter

__all__ = ("ChatService", "RawEvent", "kv_key_for")

log = structlog.get_logger("visiongate.service")


class ChatService:
    """Turns (session, options) into a streamed answer; persists the turn when done."""

    def __init__(
        self,
        *,
        engine: Engine,
        vision: VisionResolver,
        sessions: SessionStore,
        max_output_tokens_limit: int,
        telemetry: Telemetry | None = None,
        meter: TokenMeter | None = None,
    ) -> None:
        self.engine = engine
        self.vision = vision
        self.sessions = sessions
        self.max_output_tokens_limit = max_output_tokens_limit
        self.telemetry = telemetry or NoopTelemetry()
        # a managed key's token limits and usage (gateway.chat.metering); None: not counted
        self.meter = meter
        # what an image not encoded yet counts as (a key's token limits, an incomplete answer's
        # usage)
        self.image_tokens_estimate = image_tokens_estimate(engine, getattr(vision, "encoder", None))

    def _trace(self, options: ResponseOptions, session_id: str | None, t0: float) -> ResponseTrace:
        return ResponseTrace(
            self.telemetry,
            model=self.engine.model_id,
            api=options.api,
            response_id=options.client_id or options.response_id,
            session_id=session_id,
            started_ns=time.time_ns() - int((time.perf_counter() - t0) * 1e9),
        )

    async def respond(
        self,
        session: Session,
        options: ResponseOptions,
        *,
        pending: dict[str, asyncio.Task[Resolved]] | None = None,
        received_at: float | None = None,
    ) -> AsyncIterator[ServiceEvent]:
        """Stream one response. `pending` holds pre-encodes already running, by digest; they are
        awaited instead of started again. Closing the iterator early cancels generation."""
        t0 = received_at if received_at is not None else time.perf_counter()
        trace = self._trace(options, session.id, t0)
        if options.session_load_ns is not None:
            trace.span("session.load", *options.session_load_ns)
        ending = Ending(trace)

        async def failed(error: GatewayError) -> Finished:
            return await self._unanswered(session, options, t0, "failed", error=error)

        async def keep(partial: str) -> None:
            # what was streamed stays in the conversation, as an incomplete answer, and counts
            # in its usage as in the key's (the input estimate, a token a delta streamed)
            if partial:
                cost = SessionUsage(
                    responses=1, input_tokens=estimate, output_tokens=len(ending.partial)
                )
                try:
                    await fill_place(self.sessions, session, options, partial, "incomplete", cost)
                except GatewayError:  # logged; its place is left out and removed later
                    pass
            else:
                await drop_place(self.sessions, session, options)

        estimate = input_estimate(session, options, self.image_tokens_estimate)
        reserve = output_reservation(session, options, self.max_output_tokens_limit)
        metered, refused = await admitted(
            self.meter, session.owner, estimate, options, t0, ending, reserve
        )
        if refused is not None:
            yield refused
            return
        # one loop reads the events, counts them and guards their end (no generator between
        # the turn's and the consumer: each would be resumed for every delta)
        inner = self._respond(session, options, pending or {}, t0, ending)
        guard = Guard(inner, ending, options, t0, failed, keep)
        try:
            try:
                async for event in inner:
                    if metered is not None:
                        if type(event) is TextChunk:  # a delta: counted, nothing to wait for
                            observe(metered, event)
                        else:
                            await count(metered, event)
                    yield event
            except Exception as exc:
                end = await guard.failure(exc)
                if end is not None:
                    if metered is not None:
                        await count(metered, end)
                    yield end
        finally:  # a consumer gone: the guard's ending runs now, not when it is collected
            await guard.release()
            if metered is not None:
                metered.close()

    async def respond_raw(
        self,
        prompts: list[str | tuple[int, ...]],
        options: ResponseOptions,
        *,
        owner: str,
        received_at: float | None = None,
    ) -> AsyncIterator[RawEvent]:
        """Stream the answers to raw prompts (texts or token ids the engine takes as they are,
        without the chat template), `options.n` each: answer `i * n + j` is prompt i's j-th.
        Yields `Started`, `TextChunk`s, a `ChoiceEnd` as each answer ends, then one `Finished`
        (usage summed over the prompts). Nothing is stored. The sampling values are the
        options' (greedy and top-p 1 where not given); `owner` has the fair share and the
        prefix-cache namespace (narrowed by `options.cache_salt`)."""
        t0 = received_at if received_at is not None else time.perf_counter()
        ending = Ending(self._trace(options, None, t0))

        async def failed(error: GatewayError) -> Finished:
            timings = {"total_ms": ms_since(t0)}
            return Finished(
                options.response_id, options.item_id, "failed", "", error=error, timings=timings
            )

        estimate = raw_input_estimate(prompts)
        reserve = raw_output_reservation(prompts, options, self.max_output_tokens_limit)
        metered, refused = await admitted(self.meter, owner, estimate, options, t0, ending, reserve)
        if refused is not None:
            yield refused
            return
        inner = raw_events(
            self.engine, self.max_output_tokens_limit, prompts, options, owner, t0, ending
        )
        guard = Guard(inner, ending, options, t0, failed, None)
        try:  # as in `respond`
            try:
                async for event in inner:
                    if metered is not None:
                        if type(event) is TextChunk:  # a delta: counted, nothing to wait for
                            observe(metered, event)
                        else:
                            await count(metered, event)
                    yield event
            except Exception as exc:
                end = await guard.failure(exc)
                if end is not None:
                    if metered is not None:
                        await count(metered, end)
                    yield end
        finally:
            await guard.release()
            if metered is not None:
                metered.close()

    async def _respond(
        self,
        session: Session,
        options: ResponseOptions,
        pending: dict[str, asyncio.Task[Resolved]],
        t0: float,
        ending: Ending,
    ) -> AsyncIterator[ServiceEvent]:
        # The answer's place in the conversation is taken now, as the Realtime API does at
        # response.output_item.added: items the client adds while it streams come after it.
        await take_place(self.sessions, session, options)
        yield Started(options.response_id, options.item_id)

        # 1. visual tokens for every image the conversation references (or, for an engine that
        # encodes images itself, their original bytes)
        t_enc = time.perf_counter()
        originals: dict[str, bytes] = {}
        try:
            if self.engine.capabilities.image_input == "bytes":
                images, waited = {}, False
                originals = await self._originals(session)
            else:
                images, waited = await self._resolve_images(
                    session, pending, ending.trace, options.cancel
                )
        except GatewayError as exc:
            yield ending.finish(await self._unanswered(session, options, t0, "failed", error=exc))
            return
        hits = sum(1 for r in images.values() if r.source in ("memory", "redis"))
        vision = {"vision_hits": hits, "vision_misses": len(images) - hits}
        # encode time is what this response waited for encodes still running (or started by
        # it); tokens from the cache or from a pre-encode that already finished cost none
        encode_wait_ms = ms_since(t_enc) if waited else 0.0
        if options.cancel.is_set():  # cancelled while waiting for images
            cancelled = await self._unanswered(
                session, options, t0, "cancelled", reason="client_cancelled"
            )
            yield ending.finish(cancelled)
            return

        # 2. the prompt, fitted to the model's context
        sampling = sampling_for(session, options, self.max_output_tokens_limit)
        try:
            messages, dropped = await fit_messages(
                self.engine,
                turn_messages(self.vision, session, options, images, originals),
                sampling.max_output_tokens,
                options.truncation or session.truncation,
            )
        except GatewayError as exc:
            failed = await self._unanswered(session, options, t0, "failed", error=exc, **vision)
            yield ending.finish(failed)
            return
        request = GenerationRequest(
            request_id=options.response_id,
            messages=messages,
            sampling=sampling,
            # an answer kept out of the conversation leaves nothing worth keeping
            kv_key=kv_key_for(session.owner, session.id) if options.store else None,
            cancel=options.cancel,
            cache_salt=cache_salt_for(session.owner, options.cache_salt),
            owner=session.owner,
        )

        # 3. generate
        text_parts: list[str] = []  # the first answer's (the one stored)
        gen = Generation(t0, ending.trace, getattr(self.vision.encoder, "observe_ttft", None))
        # the engine's stream read here (`Generation.start`, `take`, `end`): no generator between
        stream = gen.start(self.engine, request)
        try:
            async for item in stream:
                if (delta := gen.take(item)) is None:
                    continue
                if delta.index == 0:
                    text_parts.append(delta.text)
                    ending.partial.append(delta.text)
                yield TextChunk(delta.text, index=delta.index, logprobs=delta.logprobs)
        except EngineError as exc:
            gen.refused(exc)
        except (asyncio.CancelledError, GeneratorExit):
            gen.abandon(request)
            raise
        finally:
            await gen.end(stream, request)
        results = gen.results
        result = results.get(0) if len(results) == sampling.n else None
        image_tokens_total = sum(r.image.tokens_total for r in images.values())
        timings = {
            "queue_ms": 0.0,
            "encode_ms": encode_wait_ms,
            "prefill_ms": 0.0,
            "decode_ms": 0.0,
            "ttft_ms": gen.ttft_ms,
            "total_ms": ms_since(t0),
        }
        if gen.error is not None or result is None:
            failed = await self._unanswered(
                session,
                options,
                t0,
                "failed",
                text="".join(text_parts),
                error=gen.error
                or GatewayError("engine_error", "the engine ended without a result"),
                image_tokens_total=image_tokens_total,
                timings=timings,
                **vision,
            )
            yield ending.finish(failed, gen.first_ns)
            return
        ending.trace.llm(gen.generate_ns, result)
        status, reason = response_status_of(result)
        timings.update(
            queue_ms=result.queue_ms, prefill_ms=result.prefill_ms, decode_ms=result.decode_ms
        )
        if gen.first_ns is not None:
            timings["gateway_ms"] = max(
                gen.ttft_ms - encode_wait_ms - result.queue_ms - result.prefill_ms, 0.0
            )
        choices = [choice_end(i, results[i]) for i in range(sampling.n)] if sampling.n > 1 else []

        # 4. the answer fills its place in the conversation (a cancelled one too, as incomplete);
        # only once it is written does the response end as given
        try:
            await fill_place(
                self.sessions,
                session,
                options,
                result.text,
                "completed" if status == "completed" else "incomplete",
                SessionUsage(
                    responses=1,
                    input_tokens=result.input_tokens,
                    cached_tokens=result.cached_tokens,
                    image_tokens=result.image_tokens,
                    output_tokens=sum(r.output_tokens for r in results.values()),
                ),
            )
        except GatewayError as exc:  # not stored: failed, with what it cost (it was computed)
            failed = await self._unanswered(
                session,
                options,
                t0,
                "failed",
                text=result.text,
                error=exc,
                input_tokens=result.input_tokens,
                image_tokens=result.image_tokens,
                image_tokens_total=image_tokens_total,
                text_tokens=result.input_tokens - result.image_tokens,
                output_tokens=sum(r.output_tokens for r in results.values()),
                cached_tokens=result.cached_tokens,
                timings=timings,
                **vision,
            )
            yield ending.finish(failed, gen.first_ns)
            return
        done = Finished(
            options.response_id,
            options.item_id,
            status,
            result.text,
            reason=reason,
            input_tokens=result.input_tokens,
            image_tokens=result.image_tokens,
            image_tokens_total=image_tokens_total,
            text_tokens=result.input_tokens - result.image_tokens,
            output_tokens=sum(r.output_tokens for r in results.values()),
            cached_tokens=result.cached_tokens,
            cached_image_tokens=result.cached_image_tokens,
            kv_warmed_tokens=result.warmed_tokens,
            visual_budget=_budget_in_force(self.vision),
            timings=timings,
            truncated_items=dropped,
            choices=choices,
            logprobs=result.logprobs,
            **vision,
        )
        yield ending.finish(done, gen.first_ns)

    # -- the answer's place in the conversation ------------------------------------------------

    async def _unanswered(
        self,
        session: Session,
        options: ResponseOptions,
        t0: float,
        status: Status,
        *,
        text: str = "",
        **fields: Any,
    ) -> Finished:
        """The end of a response that leaves no answer in the conversation: its place goes."""
        await drop_place(self.sessions, session, options)
        fields.setdefault("timings", {"total_ms": ms_since(t0)})
        return Finished(options.response_id, options.item_id, status, text, **fields)

    # -- the session's images ------------------------------------------------------------------

    async def _resolve_images(
        self,
        session: Session,
        pending: dict[str, asyncio.Task[Resolved]],
        trace: ResponseTrace,
        cancel: threading.Event,
    ) -> tuple[dict[str, Resolved], bool]:
        """Resolved tokens by digest, and whether any of them had to be waited for. The images
        are the session owner's: the resolver refuses any other key's (`image_not_found`)."""
        digests = session.image_digests
        if not digests:
            return {}, False
        waited = False

        async def one(digest: str) -> Resolved:
            nonlocal waited
            span, traceparent = trace.start_image(digest)
            # a pre-encode started when the image arrived is joined, not repeated; it is
            # consumed here, so the next response finds the tokens in the cache (a hit)
            task = pending.pop(digest, None)
            try:
                if task is not None:
                    waited |= not task.done()
                    resolved = await asyncio.shield(task)
                else:
                    resolved = await self.vision.resolve(
                        session.owner, digest, traceparent=traceparent
                    )
                    waited |= resolved.source in ("encoded", "joined")
            except BaseException as exc:
                trace.image_failed(span, exc)
                raise
            trace.image(span, resolved)
            return resolved

        gathered = asyncio.ensure_future(asyncio.gather(*(one(d) for d in digests)))
        # a cancel must not wait for encodes; they go on (shielded) and fill the cache
        while not gathered.done():
            await asyncio.wait({gathered}, timeout=0.05)
            if cancel.is_set() and not gathered.done():
                gathered.cancel()
                await asyncio.gather(gathered, return_exceptions=True)
                return {}, True
        return dict(zip(digests, gathered.result(), strict=True)), waited

    async def _originals(self, session: Session) -> dict[str, bytes]:
        """The bytes of every image the conversation references, by digest (the session
        owner's only: any other key's is `image_not_found`)."""
        digests = session.image_digests
        found = await asyncio.gather(*(self.vision.original(session.owner, d) for d in digests))
        return dict(zip(digests, found, strict=True))

    # -- KV warm-up ----------------------------------------------------------------------------

    def schedule_warm_up(
        self,
        session_id: str,
        owner: str,
        *,
        pending: dict[str, asyncio.Task[Resolved]] | None = None,
        then_image: str | None = None,
        new_session: Session | None = None,
    ) -> asyncio.Task[WarmUpResult | None] | None:
        """Warm the session's KV in the background (`warm_up`) from the stored session as it
        is now (`new_session` when it is not stored yet; else nothing is warmed); None when the
        engine cannot warm up. Its failures are logged, never raised."""
        if not self.engine.capabilities.warm_up:
            return None

        async def run() -> WarmUpResult | None:
            try:
                try:
                    session = await self.sessions.load(session_id, owner)
                except GatewayError as exc:
                    if exc.code != "session_not_found" or new_session is None:
                        return None
                    session = new_session
                return await self.warm_up(session, pending=pending, then_image=then_image)
            except Exception:  # a warm-up only ever saves time
                log.exception("kv_warmup_failed", session_id=session_id)
                return None

        task = asyncio.ensure_future(run())
        background.add(task)
        task.add_done_callback(background.discard)
        return task

    async def warm_up(
        self,
        session: Session,
        *,
        pending: dict[str, asyncio.Task[Resolved]] | None = None,
        then_image: str | None = None,
    ) -> WarmUpResult | None:
        """The session's KV warm-up over this service's engine and vision cache (see
        `gateway.chat.session_warmup.warm_up`)."""
        return await warm_up(
            self.engine,
            self.vision,
            self.telemetry,
            self.max_output_tokens_limit,
            session,
            pending=pending,
            then_image=then_image,
        )


def _budget_in_force(vision: VisionResolver) -> float | None:
    """The keep-ratio cap new images get now (an adaptive visual budget); None without one."""
    budget = getattr(vision.encoder, "budget", None)
    return None if budget is None else budget.in_force
