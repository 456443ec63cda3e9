"""The engine's side of a response: its deltas as the service reads them, its refusals as errors.

`Generation` runs one `GenerationRequest`: it hands on the text deltas, keeps the results by
choice, notes the first token (time to first token, on the trace and to an adaptive visual
budget) and turns an engine refusal into a `GatewayError` with a stable code (`busy` with its
Retry-After, the engine's own codes, else `engine_error`), kept as `error` rather than raised.
Whatever ends it early (a cancel, the consumer gone, a refusal) sets the request's cancel, so
the engine frees the slot at once, and its stream is always closed.

`generate_all` runs several raw prompts of one request (`/v1/completions`), a bounded number
in the engine at a time, and merges their deltas as they come; its first failure ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from gateway.chat.events import ChoiceEnd, Finished, ServiceEvent, Started, Status, TextChunk
from gateway.chat.turn_prompt import cache_salt_for
from gateway.engine.interface import (
    EngineBusy,
    EngineError,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    TextDelta,
)
from gateway.protocol.errors import ERROR_CODES, GatewayError

if TYPE_CHECKING:
    from gateway.chat.events import ResponseOptions
    from gateway.chat.response_trace import ResponseTrace
    from gateway.engine.interface import Delta, Engine

RawEvent = ServiceEvent | ChoiceEnd  # what `ChatService.respond_raw` yields

__all__ = (
    "MAX_PROMPTS_AT_ONCE",
    "Ending",
    "Generation",
    "Guard",
    "RawEvent",
    "background",
    "choice_end",
    "engine_failure",
    "generate_all",
    "ms_since",
    "raw_events",
    "response_status_of",
)

log = structlog.get_logger("visiongate.service")

MAX_PROMPTS_AT_ONCE = 8  # raw prompts of one request in the engine at the same time


def ms_since(t0: float) -> float:
    """Milliseconds since `t0` (a `time.perf_counter()` reading), to the microsecond."""
    return round((time.perf_counter() - t0) * 1e3, 3)


def engine_failure(exc: EngineError) -> GatewayError:
    """An engine's refusal as the gateway's error: a full queue is `busy` (with its retry
    hint); the engine's codes are kept (invalid_image, invalid_request,
    context_length_exceeded, ...); anything else is an engine error."""
    if isinstance(exc, EngineBusy):
        return GatewayError("busy", str(exc), retry_after_s=exc.retry_after_s)
    code = exc.code if exc.code in ERROR_CODES else "engine_error"
    return GatewayError(code, str(exc))


def response_status_of(result: GenerationResult) -> tuple[Status, str | None]:
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


class Generation:
    """One response's time to first token, its engine results and its engine error."""

    __slots__ = ("error", "first_ns", "generate_ns", "observe", "results", "t0", "trace", "ttft_ms")

    def __init__(
        self, t0: float, trace: ResponseTrace, observe: Callable[[float], Any] | None = None
    ) -> None:
        self.t0, self.trace, self.observe = t0, trace, observe
        self.results: dict[int, GenerationResult] = {}
        self.ttft_ms = 0.0
        self.first_ns: int | None = None  # epoch ns of the first text
        self.generate_ns = 0  # when the request went to the engine (epoch ns)
        self.error: GatewayError | None = None

    def text_arrived(self) -> None:
        """Note the first token (the later ones change nothing)."""
        if self.first_ns is not None:
            return
        self.ttft_ms, self.first_ns = ms_since(self.t0), time.time_ns()
        self.trace.first_token(self.ttft_ms)
        if self.observe is not None:  # an adaptive visual budget follows the TTFT objective
            self.observe(self.ttft_ms)

    def start(self, engine: Engine, request: GenerationRequest) -> AsyncIterator[Delta]:
        """The engine's stream for `request`. Its reader hands each delta to `take`, a refusal
        to `refused`, and ends it with `end` whatever happens (a cancel or the reader gone:
        `abandon` first)."""
        self.generate_ns = time.time_ns()
        return engine.generate(request)

    def take(self, delta: Delta) -> TextDelta | None:
        """A text delta as it is (its first token noted); a choice's result kept, None."""
        if isinstance(delta, TextDelta):
            if self.first_ns is None:
                self.text_arrived()
            return delta
        self.results[delta.index] = delta
        return None

    def refused(self, exc: EngineError) -> None:
        self.error = engine_failure(exc)

    @staticmethod
    def abandon(request: GenerationRequest) -> None:
        """The reader is cancelled or gone: the engine frees the slot at once."""
        request.cancel.set()

    async def end(self, stream: AsyncIterator[Delta], request: GenerationRequest) -> None:
        """Close the engine's stream; a request without every result is cancelled first."""
        if len(self.results) < request.sampling.n:
            request.cancel.set()
        await stream.aclose()  # type: ignore[attr-defined]


class Ending:
    """Whether a response has ended, and the text sent so far (kept if its consumer goes
    away). `finish` is the one way a response ends: its trace is finished with it.

    The trace's end (the root span, the access line, the response's metrics) is timed when the
    response ends and written on the event loop's next turn: the `Finished` goes on to the
    client's last frames first (`response.done`, an SSE answer's `[DONE]` and end), which they
    wait for, and the loop runs the callback before it handles anything that arrived since, so a
    request or frame the client sends after its answer finds the line written and the
    metrics counted."""

    __slots__ = ("finished", "partial", "trace")

    def __init__(self, trace: ResponseTrace) -> None:
        self.trace = trace
        self.finished = False
        self.partial: list[str] = []

    def finish(self, done: Finished, stream_start_ns: int | None = None) -> Finished:
        self.finished = True
        end_ns = time.time_ns()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test's direct call): at once
            self._write_trace(done, stream_start_ns, end_ns)
        else:
            loop.call_soon(self._write_trace, done, stream_start_ns, end_ns)
        return done

    def _write_trace(self, done: Finished, stream_start_ns: int | None, end_ns: int) -> None:
        try:
            self.trace.finish(done, stream_start_ns=stream_start_ns, end_ns=end_ns)
        except Exception:  # never the loop's unhandled callback error: logged as the response's
            log.exception("response_trace_failed", response_id=done.response_id)
            self.trace.root.end(end_time=end_ns)


class Guard:
    """Ends a response once whatever happens, for the loop that reads its events (`inner`):
    `failure` makes the end of a fault raised inside (`failed` makes it), with the code of a
    `GatewayError` (the session store unavailable is `busy`) and `internal_error` for anything
    else, and nothing when the response has already ended; `release`, in the loop's `finally`,
    handles a consumer gone before the end: it cancels the response, finishes its trace as
    cancelled (`client_disconnected`, with the text sent so far), closes `inner` and runs
    `keep` with that text in the background (a write that must outlive the response).

    It is an object the reading loop calls, not a generator around the events, so that a
    delta passes through no generator of its own here."""

    __slots__ = ("ending", "failed", "inner", "keep", "options", "t0")

    def __init__(
        self,
        inner: AsyncIterator[Any],
        ending: Ending,
        options: ResponseOptions,
        t0: float,
        failed: Callable[[GatewayError], Awaitable[Finished]],
        keep: Callable[[str], Awaitable[None]] | None,
    ) -> None:
        self.inner, self.ending, self.options = inner, ending, options
        self.t0, self.failed, self.keep = t0, failed, keep

    async def failure(self, exc: Exception) -> Finished | None:
        """The response's end after `exc` (logged), or None when it has already ended."""
        if isinstance(exc, GatewayError):  # a refusal with its own code: a store down is busy
            log.warning(
                "response_failed",
                response_id=self.options.response_id,
                code=exc.code,
                error=exc.message,
            )
            error = exc
        else:  # any other fault ends the response as failed, never silently
            log.exception("response_failed", response_id=self.options.response_id, exc_info=exc)
            error = GatewayError("internal_error", f"the response failed: {type(exc).__name__}")
        if self.ending.finished:
            return None
        return self.ending.finish(await self.failed(error))

    async def release(self) -> None:
        """After the loop, however it left: a response not ended is abandoned (see above)."""
        ending, options = self.ending, self.options
        if ending.finished:
            return
        ending.trace.root.set_attribute("visiongate.abandoned", True)
        options.cancel.set()
        # logged and counted as a cancelled response (an HTTP stream whose client left, a
        # gateway in front closing its upstream stream), with the text sent so far
        partial = "".join(ending.partial)
        gone = Finished(
            options.response_id,
            options.item_id,
            "cancelled",
            partial,
            reason="client_disconnected",
            timings={"total_ms": ms_since(self.t0)},
        )
        try:
            ending.trace.finish(gone)
        except Exception:
            log.exception("abandoned_trace_failed", response_id=options.response_id)
            ending.trace.root.end()
        # close the engine's stream now, not when the generator is collected
        with contextlib.suppress(BaseException):
            await self.inner.aclose()  # type: ignore[attr-defined]
        if self.keep is not None:  # runs to its end even though the caller is being cancelled
            task = asyncio.ensure_future(self.keep(partial))
            background.add(task)
            task.add_done_callback(background.discard)


def choice_end(index: int, result: GenerationResult) -> ChoiceEnd:
    status, reason = response_status_of(result)
    return ChoiceEnd(
        index,
        result.text,
        status,
        reason,
        output_tokens=result.output_tokens,
        logprobs=result.logprobs,
    )


# writes that must outlive the response that started them (a strong reference until done)
background: set[asyncio.Future[object]] = set()


async def raw_events(
    engine: Engine,
    max_output_tokens_limit: int,
    prompts: list[str | tuple[int, ...]],
    options: ResponseOptions,
    owner: str,
    t0: float,
    ending: Ending,
) -> AsyncIterator[RawEvent]:
    """The events of `ChatService.respond_raw` (its prompts, sampled as its options say)."""
    yield Started(options.response_id, options.item_id)
    sampling = SamplingParams(
        max_output_tokens=min(
            options.max_output_tokens or max_output_tokens_limit,
            max_output_tokens_limit,
        ),
        temperature=0.0 if options.temperature is None else options.temperature,
        top_p=1.0 if options.top_p is None else options.top_p,
        seed=options.seed,
        stop=options.stop,
        logprobs=options.logprobs,
        n=options.n,
    )
    requests = [
        GenerationRequest(
            request_id=f"{options.response_id}-{i}",
            messages=[],
            sampling=sampling,
            cancel=options.cancel,
            cache_salt=cache_salt_for(owner, options.cache_salt),
            owner=owner,  # the fair share of the API key
            raw_prompt=prompt,
        )
        for i, prompt in enumerate(prompts)
    ]
    n = sampling.n
    gen = Generation(t0, ending.trace)
    gen.generate_ns = time.time_ns()
    ends: dict[int, ChoiceEnd] = {}
    try:
        async for prompt, delta in generate_all(engine, requests, options.cancel):
            at = prompt * n + delta.index
            if isinstance(delta, TextDelta):
                gen.text_arrived()
                if at == 0:
                    ending.partial.append(delta.text)
                yield TextChunk(delta.text, index=at, logprobs=delta.logprobs)
                continue
            gen.results[at] = delta
            ending.trace.llm(gen.generate_ns, delta)
            ends[at] = choice_end(at, delta)
            yield ends[at]
    except GatewayError as exc:
        gen.error = exc
    # every answer of a prompt reports the prompt: count it once, from its first answer
    firsts = [r for at, r in gen.results.items() if at % n == 0]
    first = gen.results.get(0) or (firsts[0] if firsts else None)
    input_tokens = sum(r.input_tokens for r in firsts)
    status: Status = "completed"
    if gen.error is not None:
        status = "failed"
    elif any(end.reason == "max_output_tokens" for end in ends.values()):
        status = "incomplete"
    answers = [ends[at] for at in sorted(ends)]
    done = Finished(
        options.response_id,
        options.item_id,
        status,
        answers[0].text if answers else "",
        error=gen.error,
        input_tokens=input_tokens,
        text_tokens=input_tokens,
        output_tokens=sum(r.output_tokens for r in gen.results.values()),
        cached_tokens=sum(r.cached_tokens for r in firsts),
        timings={
            "queue_ms": first.queue_ms if first else 0.0,
            "prefill_ms": first.prefill_ms if first else 0.0,
            "decode_ms": first.decode_ms if first else 0.0,
            "ttft_ms": gen.ttft_ms,
            "total_ms": ms_since(t0),
        },
        choices=answers if len(answers) > 1 else [],
    )
    yield ending.finish(done, gen.first_ns)


_END = object()


async def generate_all(
    engine: Engine, requests: list[GenerationRequest], cancel: threading.Event
) -> AsyncIterator[tuple[int, Delta]]:
    """The engine's deltas of every prompt, as they come, tagged with the prompt's index; at
    most MAX_PROMPTS_AT_ONCE prompts in the engine at a time. The first failure ends it as a
    GatewayError with the engine's code; closing it cancels every prompt."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    gate = asyncio.Semaphore(MAX_PROMPTS_AT_ONCE)

    async def run(index: int, request: GenerationRequest) -> None:
        try:
            async with gate:
                if cancel.is_set():
                    return
                stream = engine.generate(request)
                try:
                    async for delta in stream:
                        queue.put_nowait((index, delta))
                finally:
                    await stream.aclose()  # type: ignore[attr-defined]
        except EngineError as exc:
            queue.put_nowait((index, engine_failure(exc)))
        except Exception as exc:
            log.exception("completion_failed", request_id=request.request_id)
            error = GatewayError("internal_error", f"the completion failed: {type(exc).__name__}")
            queue.put_nowait((index, error))
        finally:
            queue.put_nowait((index, _END))

    tasks = [asyncio.ensure_future(run(i, request)) for i, request in enumerate(requests)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, GatewayError):
                raise item
            else:
                yield index, item
    finally:
        cancel.set()
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
