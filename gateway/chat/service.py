"""Chat serving: one response over a session, independent of the transport.

`ChatService.respond` takes a loaded session and response options, resolves the session's
images to visual tokens (waiting for pre-encodes already under way rather than starting new
ones), asks the engine, and yields transport-neutral events: `Started`, `TextChunk`, then one
`Finished` carrying usage, timings and cache results. The WebSocket and HTTP layers turn those
into their own wire events; neither talks to the engine directly.

Tools reach the model as text: the tools prompt after the instructions, a stored tool call as
the text the model wrote for it (`render_answer`), a tool's result as a user turn in the tags
the prompt announces. An answer given with tools is stored as its text and tool-call parts
(`split_answer`), so a client replaying the history with `tool_calls` matches it. With several
answers to one prompt (`n`) every answer streams (`TextChunk.index`) and ends in
`Finished.choices`; only the first is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import structlog

from encoder_worker.storage import scoped_digest
from gateway.chat.events import (
    ChoiceEnd,
    Finished,
    ResponseOptions,
    ServiceEvent,
    Started,
    Status,
    TextChunk,
)
from gateway.chat.image_input import media_type
from gateway.chat.response_trace import ResponseTrace
from gateway.chat.tool_stream import ToolCall, render_answer, render_tool_result, split_answer
from gateway.chat.vision_resolver import Resolved, VisionResolver
from gateway.engine.interface import (
    Engine,
    EngineBusy,
    EngineError,
    GenerationRequest,
    GenerationResult,
    ImageInput,
    Message,
    SamplingParams,
    TextDelta,
    WarmUpResult,
    image_input_of,
)
from gateway.protocol.errors import ERROR_CODES, GatewayError
from gateway.sessions.session import Session, SessionStore, StoredItem, StoredPart, new_id
from gateway.telemetry import ATTR, NoopTelemetry, Telemetry

__all__ = ("ChatService", "kv_key_for")

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
    ) -> None:
        self.engine = engine
        self.vision = vision
        self.sessions = sessions
        self.max_output_tokens_limit = max_output_tokens_limit
        self.telemetry = telemetry or NoopTelemetry()

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
        trace = ResponseTrace(
            self.telemetry,
            model=self.engine.model_id,
            api=options.api,
            response_id=options.client_id or options.response_id,
            session_id=session.id,
            started_ns=time.time_ns() - int((time.perf_counter() - t0) * 1e9),
        )
        if options.session_load_ns is not None:
            trace.span("session.load", *options.session_load_ns)
        finished = False
        partial: list[str] = []  # text sent so far, kept if the consumer goes away

        def finish(done: Finished, stream_start_ns: int | None = None) -> Finished:
            nonlocal finished
            finished = True
            trace.finish(done, stream_start_ns=stream_start_ns)
            return done

        inner = self._respond(session, options, pending or {}, t0, trace, finish, partial)
        try:
            async for event in inner:
                yield event
        except Exception as exc:  # any fault ends the response as failed, never silently
            log.exception("response_failed", response_id=options.response_id)
            if not finished:
                error = GatewayError("internal_error", f"the response failed: {type(exc).__name__}")
                yield finish(await self._unanswered(session, options, t0, "failed", error=error))
        finally:
            if not finished:  # the consumer went away before the end
                trace.root.set_attribute("visiongate.abandoned", True)
                options.cancel.set()
                # logged and counted as a cancelled response (an HTTP stream whose client left,
                # a gateway in front closing its upstream stream), with the text sent so far
                gone = Finished(
                    options.response_id,
                    options.item_id,
                    "cancelled",
                    "".join(partial),
                    reason="client_disconnected",
                    timings={"total_ms": _ms(t0)},
                )
                try:
                    trace.finish(gone)
                except Exception:
                    log.exception("abandoned_trace_failed", response_id=options.response_id)
                    trace.root.end()
                # close the engine's stream now, not when the generator is collected
                with contextlib.suppress(BaseException):
                    await inner.aclose()
                # what was streamed stays in the conversation, as an incomplete answer; the
                # write runs to its end even though the caller is being cancelled
                keep = asyncio.ensure_future(
                    self._finish_placeholder(session, options, "".join(partial), "incomplete")
                    if partial
                    else self._drop_placeholder(session, options)
                )
                _background.add(keep)
                keep.add_done_callback(_background.discard)

    async def _respond(
        self,
        session: Session,
        options: ResponseOptions,
        pending: dict[str, asyncio.Task[Resolved]],
        t0: float,
        trace: ResponseTrace,
        finish,
        partial: list[str],
    ) -> AsyncIterator[ServiceEvent]:
        # The answer's place in the conversation is taken now, as the Realtime API does at
        # response.output_item.added: items the client adds while it streams come after it.
        if options.store:

            def place(stored: Session) -> None:
                stored.items.append(
                    StoredItem(
                        id=options.item_id,
                        role="assistant",
                        parts=[StoredPart("text", text="")],
                        status="in_progress",
                        response_id=options.response_id,
                    )
                )

            await self.sessions.update(session.id, session.owner, place)
        yield Started(options.response_id, options.item_id)

        # 1. visual tokens for every image the conversation references (or, for an engine that
        # encodes images itself, their original bytes)
        t_enc = time.perf_counter()
        originals: dict[str, bytes] = {}
        try:
            if image_input_of(self.engine) == "bytes":
                images, waited = {}, False
                originals = await self._originals(session)
            else:
                images, waited = await self._resolve_images(session, pending, trace, options.cancel)
        except GatewayError as exc:
            yield finish(await self._unanswered(session, options, t0, "failed", error=exc))
            return
        hits = sum(1 for r in images.values() if r.source in ("memory", "redis"))
        misses = len(images) - hits
        # encode time is what this response waited for encodes still running (or started by
        # it); tokens from the cache or from a pre-encode that already finished cost none
        encode_wait_ms = _ms(t_enc) if waited else 0.0

        if options.cancel.is_set():  # cancelled while waiting for images
            yield finish(
                await self._unanswered(session, options, t0, "cancelled", reason="client_cancelled")
            )
            return

        # 2. the prompt, fitted to the model's context
        messages = self._messages(session, options, images, originals)
        sampling = SamplingParams(
            max_output_tokens=min(
                options.max_output_tokens or session.max_output_tokens, self.max_output_tokens_limit
            ),
            temperature=session.temperature if options.temperature is None else options.temperature,
            top_p=session.top_p if options.top_p is None else options.top_p,
            seed=session.seed if options.seed is None else options.seed,
            stop=options.stop,
            logprobs=options.logprobs,
            n=options.n,
            grammar=options.grammar,
        )
        truncation = options.truncation or session.truncation
        try:
            messages, dropped = await self._fit(messages, sampling.max_output_tokens, truncation)
        except GatewayError as exc:
            failed = await self._unanswered(
                session, options, t0, "failed", error=exc, vision_hits=hits, vision_misses=misses
            )
            yield finish(failed)
            return
        # KV is kept per (owner, session): a session id reused by another key never meets it;
        # an answer kept out of the conversation leaves nothing worth keeping
        kv_key = kv_key_for(session.owner, session.id) if options.store else None
        # prefix caching is shared within an API key (its sessions and stateless requests alike)
        request = GenerationRequest(
            request_id=options.response_id,
            messages=messages,
            sampling=sampling,
            kv_key=kv_key,
            cancel=options.cancel,
            cache_salt=session.owner
            if options.cache_salt is None
            else f"{session.owner}\0salt:{options.cache_salt}",
            owner=session.owner,
        )

        # 3. generate
        text_parts: list[str] = []  # the first answer's (the one stored)
        results: dict[int, GenerationResult] = {}
        ttft_ms = 0.0
        first_ns: int | None = None
        error: GatewayError | None = None
        generate_ns = time.time_ns()
        stream = self.engine.generate(request)
        try:
            async for delta in stream:
                if isinstance(delta, TextDelta):
                    if first_ns is None:
                        ttft_ms, first_ns = _ms(t0), time.time_ns()
                        trace.first_token(ttft_ms)
                        # an adaptive visual budget follows the TTFT objective's burn
                        observe = getattr(self.vision.encoder, "observe_ttft", None)
                        if observe is not None:
                            observe(ttft_ms)
                    if delta.index == 0:
                        text_parts.append(delta.text)
                        partial.append(delta.text)
                    yield TextChunk(delta.text, index=delta.index, logprobs=delta.logprobs)
                else:
                    results[delta.index] = delta
        except EngineBusy as exc:  # the engine's queue is full
            error = GatewayError("busy", str(exc), retry_after_s=exc.retry_after_s)
        except EngineError as exc:
            # the engine's refusals keep their code (invalid_image, invalid_request,
            # context_length_exceeded, ...); anything else is an engine error
            code = exc.code if exc.code in ERROR_CODES else "engine_error"
            error = GatewayError(code, str(exc))
        except (asyncio.CancelledError, GeneratorExit):
            request.cancel.set()
            raise
        finally:
            if len(results) < sampling.n:
                request.cancel.set()
            await stream.aclose()
        result = results.get(0) if len(results) == sampling.n else None

        text = "".join(text_parts)
        image_tokens_total = sum(r.image.tokens_total for r in images.values())
        timings = {
            "queue_ms": 0.0,
            "encode_ms": encode_wait_ms,
            "prefill_ms": 0.0,
            "decode_ms": 0.0,
            "ttft_ms": ttft_ms,
            "total_ms": _ms(t0),
        }
        if error is not None or result is None:
            error = error or GatewayError("engine_error", "the engine ended without a result")
            failed = await self._unanswered(
                session,
                options,
                t0,
                "failed",
                text=text,
                error=error,
                vision_hits=hits,
                vision_misses=misses,
                image_tokens_total=image_tokens_total,
                timings=timings,
            )
            yield finish(failed, first_ns)
            return
        trace.llm(generate_ns, result)
        status, reason = _status(result)
        timings.update(
            queue_ms=result.queue_ms, prefill_ms=result.prefill_ms, decode_ms=result.decode_ms
        )
        if first_ns is not None:
            timings["gateway_ms"] = max(
                ttft_ms - encode_wait_ms - result.queue_ms - result.prefill_ms, 0.0
            )
        choices: list[ChoiceEnd] = []
        if sampling.n > 1:
            for index in range(sampling.n):
                each = results[index]
                choice_status, choice_reason = _status(each)
                choices.append(
                    ChoiceEnd(
                        index,
                        each.text,
                        choice_status,
                        choice_reason,
                        output_tokens=each.output_tokens,
                        logprobs=each.logprobs,
                    )
                )

        # 4. the answer fills its place in the conversation (a cancelled one too, as incomplete)
        store_error = await self._finish_placeholder(
            session, options, result.text, "completed" if status == "completed" else "incomplete"
        )

        yield finish(
            Finished(
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
                vision_hits=hits,
                vision_misses=misses,
                timings=timings,
                truncated_items=dropped,
                store_error=store_error,
                choices=choices,
                logprobs=result.logprobs,
            ),
            first_ns,
        )

    async def _fit(
        self,
        messages: list[Message],
        max_output_tokens: int,
        truncation: Literal["auto", "disabled"],
    ) -> tuple[list[Message], int]:
        """The messages that fit the model's context with room for the answer, and how many
        conversation messages were left out. "auto" leaves out the oldest turns (the
        instructions and the latest message always stay); "disabled" refuses instead.
        Token counts are upper bounds (template overhead included), taken off the event loop."""
        context = self.engine.context_tokens
        room = context - min(max_output_tokens, context // 4)
        # an image sent as bytes has no tokens here yet: the engine's estimate of what it
        # becomes upstream (0 when it gives none)
        per_image = int(getattr(self.engine, "image_tokens_estimate", 0) or 0)

        def cost(message: Message, count: Callable[[str], int]) -> int:
            n = MESSAGE_OVERHEAD_TOKENS
            for part in message.content:
                if isinstance(part, str):
                    n += count(part) if part else 0
                else:
                    tokens = part.num_tokens if part.embeds is not None else per_image
                    n += tokens + IMAGE_OVERHEAD_TOKENS
            return n

        # a byte-level tokenizer never makes more tokens than the text has UTF-8 bytes: most
        # turns fit by that bound alone and are never tokenized here
        if sum(cost(m, lambda text: len(text.encode())) for m in messages) <= room:
            return messages, 0
        loop = asyncio.get_running_loop()
        costs = await loop.run_in_executor(
            _counting, lambda: [cost(m, self.engine.count_tokens) for m in messages]
        )
        total = sum(costs)
        if total <= room:
            return messages, 0
        head = 1 if messages and messages[0].role == "system" else 0
        if truncation == "disabled" or len(messages) - head <= 1:
            raise GatewayError(
                "context_length_exceeded",
                f"the conversation needs about {total} tokens and "
                f"the model takes {context}, {context - room} of them kept for the answer; "
                + (
                    'delete older items or set truncation to "auto"'
                    if truncation == "disabled"
                    else "shorten the latest message"
                ),
                param="messages",
            )
        # drop whole turns from the oldest on; a turn never starts with an assistant message
        start = head
        while start < len(messages) - 1 and (total > room or messages[start].role == "assistant"):
            total -= costs[start]
            start += 1
        if total > room:
            raise GatewayError(
                "context_length_exceeded",
                f"the latest message needs about "
                f"{total} tokens; the model takes {context}, {context - room} of "
                "them kept for the answer",
                param="messages",
            )
        kept = messages[:head] + messages[start:]
        log.info("context_truncated", dropped=start - head, kept_tokens=total, context=context)
        return kept, start - head

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
        await self._drop_placeholder(session, options)
        fields.setdefault("timings", {"total_ms": _ms(t0)})
        return Finished(options.response_id, options.item_id, status, text, **fields)

    async def _finish_placeholder(
        self,
        session: Session,
        options: ResponseOptions,
        text: str,
        status: Literal["completed", "incomplete"],
    ) -> GatewayError | None:
        """Write the answer into its place; the error if the record could not be written."""
        if not options.store:
            return None

        parts = _answer_parts(text, options)

        def fill(stored: Session) -> None:
            for item in stored.items:
                if item.id == options.item_id:
                    item.parts = parts
                    item.status = status

        try:
            await self.sessions.update(session.id, session.owner, fill)
        except GatewayError as exc:  # the answer went out; only its record is lost
            log.error("answer_not_stored", response_id=options.response_id, code=exc.code)
            return GatewayError(
                "answer_not_stored",
                f"the answer was sent but could not be "
                f"stored in the session ({exc.code}); resend it to keep it",
            )
        return None

    async def _drop_placeholder(self, session: Session, options: ResponseOptions) -> None:
        if not options.store:
            return

        def drop(stored: Session) -> None:
            stored.items[:] = [i for i in stored.items if i.id != options.item_id]

        try:
            await self.sessions.update(session.id, session.owner, drop)
        except GatewayError as exc:
            log.error("placeholder_not_removed", response_id=options.response_id, code=exc.code)

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

    def _messages(
        self,
        session: Session,
        options: ResponseOptions,
        images: dict[str, Resolved],
        originals: dict[str, bytes] | None = None,
    ) -> list[Message]:
        instructions = (
            session.instructions if options.instructions is None else options.instructions
        )
        if options.tools_prompt:
            instructions = (
                f"{instructions}\n\n{options.tools_prompt}"
                if instructions
                else options.tools_prompt
            )
        messages: list[Message] = []
        if instructions:
            messages.append(Message("system", [instructions]))
        # host tensors: the engine moves each chunk it runs to its own device and dtype
        fingerprint = self.vision.fingerprint[:16]
        embeds_by_digest: dict[str, ImageInput] = {}
        for item in session.items:
            if item.status == "in_progress":  # another response's answer, still being written
                continue
            if item.role == "tool":  # a tool's result: the model reads it as the user's turn
                result = "".join(part.text or "" for part in item.parts)
                messages.append(Message("user", [render_tool_result(result)]))
                continue
            content: list[str | ImageInput] = []
            calls: list[ToolCall] = []
            for part in item.parts:
                if part.kind == "text":
                    content.append(part.text or "")
                elif part.kind == "tool_call":
                    calls.append(ToolCall(part.call_id or "", part.name or "", part.text or ""))
                elif originals and part.digest in originals:
                    image = embeds_by_digest.get(part.digest)
                    if image is None:
                        data = originals[part.digest]
                        # the content id an upstream keys its multimodal cache by: the digest,
                        # or a per-key name when images are not shared across API keys
                        content_id = (
                            part.digest
                            if self.vision.share_across_keys
                            else scoped_digest(session.owner, part.digest)
                        )
                        image = ImageInput(content_id, None, data=data, mime=media_type(data))
                        embeds_by_digest[part.digest] = image
                    content.append(image)
                elif part.digest in images:
                    image = embeds_by_digest.get(part.digest)
                    if image is None:
                        # the id names the tokens, not just the bytes: a new encoder config
                        # is new content
                        encoded = images[part.digest].image
                        image = ImageInput(
                            f"{fingerprint}:{part.digest}",
                            encoded.embeds("cpu"),
                            layout=encoded.layout,
                        )
                        embeds_by_digest[part.digest] = image
                    content.append(image)
            if calls:  # the calls as the model wrote them, after the text
                text = "".join(p for p in content if isinstance(p, str))
                content = [render_answer(text, calls)]
            if content:
                messages.append(Message(item.role, content))
        return messages

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
        if getattr(self.engine, "warm_up", None) is None:
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
        _background.add(task)
        task.add_done_callback(_background.discard)
        return task

    async def warm_up(
        self,
        session: Session,
        *,
        pending: dict[str, asyncio.Task[Resolved]] | None = None,
        then_image: str | None = None,
    ) -> WarmUpResult | None:
        """Prefill the session's conversation as its next response will render it, through its
        last item (a finished message: the question comes as an item of its own), or with
        `then_image` (a digest) as the start of a new user message left open (an HTTP turn
        that sends the photo and its question together), into the engine's prefix cache,
        pinned for the session. Only images whose tokens are ready are used (pre-encodes that
        finished, or the vision cache): None, without touching the engine, while any is still
        encoding or the engine cannot warm up. Traced as `llm.warmup` and counted."""
        warm = getattr(self.engine, "warm_up", None)
        if warm is None or image_input_of(self.engine) == "bytes":
            return None
        started_ns = time.time_ns()
        digests = [*session.image_digests]
        if then_image is not None and then_image not in digests:
            digests.append(then_image)
        images: dict[str, Resolved] = {}
        for digest in digests:
            task = (pending or {}).get(digest)
            if task is not None and task.done() and not task.cancelled() and not task.exception():
                images[digest] = task.result()
                continue
            if task is not None and not task.done():
                return None  # its item warms the session once it is encoded
            encoded = await self.vision.cached(session.owner, digest)
            if encoded is None:
                return None
            images[digest] = Resolved(encoded, "memory", 0.0)
        messages = self._messages(session, ResponseOptions(), images)
        if then_image is not None:
            # as `_messages` names and places it in the turn that will send it
            encoded = images[then_image].image
            image = ImageInput(
                f"{self.vision.fingerprint[:16]}:{then_image}",
                encoded.embeds("cpu"),
                layout=encoded.layout,
            )
            messages.append(Message("user", [image]))
        if not messages:
            return None
        max_tokens = min(session.max_output_tokens, self.max_output_tokens_limit)
        try:
            messages, _ = await self._fit(messages, max_tokens, session.truncation)
        except GatewayError:
            return None
        request = GenerationRequest(
            request_id=new_id("warm"),
            messages=messages,
            sampling=SamplingParams(max_output_tokens=1),
            kv_key=kv_key_for(session.owner, session.id),
            cache_salt=session.owner,
            owner=session.owner,
            warm_up="part" if then_image is not None else "message",
        )
        result: WarmUpResult = await warm(request)
        span = self.telemetry.tracer.start_span(
            "llm.warmup",
            start_time=started_ns,
            attributes={
                ATTR.SESSION_ID: session.id,
                "visiongate.warmup.outcome": result.outcome,
                "visiongate.warmup.positions": result.positions,
                ATTR.PREFILL_TOKENS: result.computed,
                "visiongate.warmup.queue_ms": result.queue_ms,
                "visiongate.warmup.prefill_ms": result.prefill_ms,
            },
        )
        if result.reason:
            span.set_attribute("visiongate.warmup.reason", result.reason)
        span.end()
        self.telemetry.metrics.record_kv_warmup(
            outcome=result.outcome, computed_tokens=result.computed
        )
        log.info(
            "kv_warmup",
            session_id=session.id,
            outcome=result.outcome,
            positions=result.positions,
            computed=result.computed,
            reason=result.reason or None,
        )
        return result


def _budget_in_force(vision: VisionResolver) -> float | None:
    """The keep-ratio cap new images get now (an adaptive visual budget); None without one."""
    budget = getattr(vision.encoder, "budget", None)
    return None if budget is None else budget.in_force


def _status(result: GenerationResult) -> tuple[Status, str | None]:
    """How an answer ended, in the service's terms: its status and why it is not complete."""
    status: Status = {
        "stop": "completed",
        "length": "incomplete",
        "cancelled": "cancelled",
        "slow_reader": "incomplete",
    }[result.finish_reason]
    reason = {
        "length": "max_output_tokens",
        "cancelled": "client_cancelled",
        "slow_reader": "slow_reader",
    }.get(result.finish_reason)
    return status, reason


def _answer_parts(text: str, options: ResponseOptions) -> list[StoredPart]:
    """An answer as stored: its text, and with tools its calls as `tool_call` parts (the text
    part only when there is text or there are no calls, as a replayed message parses)."""
    if not options.tools:
        return [StoredPart("text", text=text)]
    rest, calls = split_answer(text, options.response_id)
    parts = [StoredPart("text", text=rest)] if rest or not calls else []
    parts += [StoredPart("tool_call", text=c.arguments, name=c.name, call_id=c.id) for c in calls]
    return parts


# writes that must outlive the response that started them (a strong reference until done)
_background: set[asyncio.Future[object]] = set()
# one thread counts tokens for every response: a tokenizer is not shared across threads
_counting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="count-tokens")

# conservative per-part costs of the chat template around the content, in tokens: role markers
# and separators per message; image wrappers (and a VLM's tile and row markers) per image
MESSAGE_OVERHEAD_TOKENS = 8
IMAGE_OVERHEAD_TOKENS = 32


def kv_key_for(owner: str, session_id: str) -> str:
    """The engine's KV namespace for a session: owner and id together, hashed."""
    return hashlib.sha256(f"{owner}\0{session_id}".encode()).hexdigest()[:32]


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 3)
