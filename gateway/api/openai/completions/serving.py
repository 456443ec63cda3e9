"""Serving the legacy `POST /v1/completions`: plain-text prompts, no chat template, no session.

Evaluation harnesses speak this API. Each prompt, a text or a list of token ids, goes to the
engine as it is (`GenerationRequest.raw_prompt`), with the same rate limit as chat, the same
fair share of the engine (`cache_salt` is the API key's owner id, which also scopes prefix
caching) and the same trace and response metrics. A list of prompts gives `n` choices per
prompt, choice `i * n + j` being prompt i's j-th. `logprobs` (0..5) come in the legacy layout:
`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob} (the k most likely and the
sampled token) and `text_offset`. `echo` puts the prompt before the answer; with `logprobs` it
is refused, since the prompt's own log-probabilities are not computed. Without `temperature` the
answer is greedy, as chat's is by default; `max_tokens` defaults to 16, as OpenAI's does. As in
chat, an answer starts only at the first text (or the end), so a failure before any output gets
its HTTP status, and a client that disconnects cancels generation.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import anyio
import msgspec
import structlog
from msgspec import Struct

from gateway.api.http.event_streams import close_shielded, replay
from gateway.api.openai.chat import protocol as p
from gateway.api.openai.chat.serving import DONE, EventStream
from gateway.chat.events import Finished
from gateway.chat.requests import (
    RequestLimits,
    check_cache_salt,
    check_choices,
    check_max_tokens,
    check_model,
    check_prompt_tokens,
    check_sampling,
    check_stop,
    check_text,
)
from gateway.chat.response_trace import ResponseTrace
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
    from gateway.engine.interface import Delta, Engine, TokenLogprob
    from gateway.server.state import GatewayState

__all__ = (
    "Completion",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionServing",
    "CompletionUsage",
    "LegacyLogprobs",
)

log = structlog.get_logger("visiongate.http")

_json = msgspec.json.Encoder()
DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions
MAX_LEGACY_LOGPROBS = 5
MAX_PROMPTS = 64  # prompts in one request
MAX_PROMPTS_AT_ONCE = 8  # of them, in the engine at the same time


# ---------------------------------------------------------------- wire shapes


class CompletionRequest(Struct):
    model: str
    prompt: str | list[Any]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    stream: bool | None = None
    stream_options: p.StreamOptions | None = None
    suffix: str | None = None
    best_of: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, int] | None = None
    user: str | None = None  # accepted and ignored
    # as vLLM's: prefix-cache entries are shared only between requests with the same salt,
    # within the API key's own
    cache_salt: str | None = None


class LegacyLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: LegacyLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class CompletionUsage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: p.PromptTokensDetails


class Completion(Struct, tag="text_completion", tag_field="object", omit_defaults=True):
    """A completion, or (streaming) one chunk of it: chunks leave `usage` out."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: CompletionUsage | None = None


# ---------------------------------------------------------------- serving


@dataclass(slots=True)
class _Choice:
    """One choice as it is built: its text, its tokens' log-probabilities, how it ended."""

    prefix: str  # the echoed prompt, or ""
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    offset: int = 0  # text_offset of its next token (the echoed prompt counts)
    finish_reason: Literal["stop", "length"] | None = None
    echoed: bool = False


@dataclass(slots=True)
class _Run:
    request: CompletionRequest
    prompts: list[str | tuple[int, ...]]
    n: int
    logprobs: int | None
    completion_id: str
    created: int
    model: str
    cancel: threading.Event
    trace: ResponseTrace
    received: float
    choices: list[_Choice]
    results: list[GenerationResult] = field(default_factory=list)
    first_ns: int | None = None
    generate_ns: int = 0  # when the prompts went to the engine (epoch ns)
    ttft_ms: float = 0.0


class CompletionServing:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.limits = RequestLimits.of(state.settings)

    async def create(
        self, request: CompletionRequest, *, owner: str
    ) -> Completion | EventStream | p.ErrorResponse:
        received = time.perf_counter()
        try:
            run, requests = await self._prepare(request, owner, received)
        except GatewayError as exc:
            return p.error_response(exc)
        run.generate_ns = time.time_ns()
        deltas = _generate_all(self.state.engine, requests, run.cancel)
        first: list[tuple[int, Delta]] = []
        try:
            # run until the first text or the end, so a failure still gets its HTTP status
            while not first or not isinstance(first[-1][1], TextDelta):
                first.append(await deltas.__anext__())
        except StopAsyncIteration:
            pass
        except GatewayError as exc:
            await close_shielded(deltas)
            self._finish(run, exc)
            return p.error_response(exc)
        except BaseException:
            run.cancel.set()
            await close_shielded(deltas)
            raise
        if request.stream:
            return EventStream(self._sse(run, first, deltas), None)
        try:
            async for index, delta in replay(first, deltas, _never):
                self._take(run, index, delta)
        except GatewayError as exc:
            self._finish(run, exc)
            return p.error_response(exc)
        finally:
            run.cancel.set()
            await close_shielded(deltas)
        self._finish(run)
        return Completion(
            id=run.completion_id,
            created=run.created,
            model=run.model,
            choices=[
                CompletionChoice(
                    index=i,
                    text=c.prefix + "".join(c.text),
                    logprobs=_legacy(c.logprobs, len(c.prefix))
                    if run.logprobs is not None
                    else None,
                    finish_reason=c.finish_reason or "stop",
                )
                for i, c in enumerate(run.choices)
            ],
            system_fingerprint=self._fingerprint(),
            usage=_usage(run),
        )

    async def _prepare(
        self, request: CompletionRequest, owner: str, received: float
    ) -> tuple[_Run, list[GenerationRequest]]:
        state, limits = self.state, self.limits
        state.require()  # the one "busy" answer while the model loads
        model = state.engine.model_id
        check_model(request.model, model)
        prompts = _prompts(request.prompt, limits, _vocab_size(state.engine))
        if request.echo and any(not isinstance(prompt, str) for prompt in prompts):
            raise _invalid("echo takes text prompts; send the prompt as text to echo it", "echo")
        n = check_choices(request.n)
        _check_unsupported(request, n)
        logprobs = request.logprobs
        if logprobs is not None and (
            isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_LEGACY_LOGPROBS
        ):
            raise _invalid(f"logprobs must be an integer in 0..{MAX_LEGACY_LOGPROBS}", "logprobs")
        if request.echo and logprobs is not None:
            raise _invalid(
                "echo with logprobs is not supported: the prompt's log-probabilities are not "
                "computed; ask without echo",
                "echo",
            )
        check_sampling(request.temperature, request.top_p, request.seed)
        max_tokens = check_max_tokens(
            DEFAULT_MAX_TOKENS if request.max_tokens is None else request.max_tokens,
            limits.max_output_tokens_limit,
            "max_tokens",
        )
        check_cache_salt(request.cache_salt)
        sampling = SamplingParams(
            max_output_tokens=max_tokens or DEFAULT_MAX_TOKENS,
            temperature=0.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            seed=request.seed,
            stop=check_stop(request.stop),
            logprobs=logprobs,
            n=n,
        )
        await state.rate_limiter.acquire(owner)
        completion_id = f"cmpl-{secrets.token_hex(12)}"
        cancel = threading.Event()
        requests = [
            GenerationRequest(
                request_id=f"{completion_id}-{i}",
                messages=[],
                sampling=sampling,
                cancel=cancel,
                # the prefix-cache namespace of the API key (narrowed by a client's salt)
                cache_salt=owner
                if request.cache_salt is None
                else f"{owner}\0salt:{request.cache_salt}",
                owner=owner,  # the fair share of the API key
                raw_prompt=prompt,
            )
            for i, prompt in enumerate(prompts)
        ]
        trace = ResponseTrace(
            state.telemetry,
            model=model,
            api="completions",
            response_id=completion_id,
            session_id=None,
            started_ns=time.time_ns() - int((time.perf_counter() - received) * 1e9),
        )
        run = _Run(
            request=request,
            prompts=prompts,
            n=n,
            logprobs=logprobs,
            completion_id=completion_id,
            created=int(time.time()),
            model=model,
            cancel=cancel,
            trace=trace,
            received=received,
            choices=[
                _Choice(prefix=prompt, offset=len(prompt))
                if request.echo and isinstance(prompt, str)
                else _Choice(prefix="")
                for prompt in prompts
                for _ in range(n)
            ],
        )
        return run, requests

    def _take(self, run: _Run, index: int, delta: Delta) -> tuple[_Choice, int, list]:
        """Add one delta of prompt `index` to its choice; (the choice, its index, the delta's
        log-probabilities)."""
        at = index * run.n + delta.index
        choice = run.choices[at]
        if isinstance(delta, TextDelta):
            if run.first_ns is None:
                run.first_ns = time.time_ns()
                run.ttft_ms = _ms(run.received)
                run.trace.first_token(run.ttft_ms)
            choice.text.append(delta.text)
            choice.logprobs.extend(delta.logprobs)
            return choice, at, list(delta.logprobs)
        run.results.append(delta)
        run.trace.llm(run.generate_ns, delta)
        choice.finish_reason = "length" if delta.finish_reason == "length" else "stop"
        choice.logprobs.extend(delta.logprobs)
        return choice, at, list(delta.logprobs)

    async def _sse(
        self, run: _Run, first: list[tuple[int, Delta]], deltas: AsyncIterator[tuple[int, Delta]]
    ) -> AsyncIterator[bytes]:
        include_usage = bool(
            run.request.stream_options and run.request.stream_options.include_usage
        )
        done = False
        try:
            try:
                async for index, delta in replay(first, deltas, _never):
                    choice, at, logprobs = self._take(run, index, delta)
                    text = delta.text if isinstance(delta, TextDelta) else ""
                    if not choice.echoed:
                        text, choice.echoed = choice.prefix + text, True
                    legacy = None
                    if run.logprobs is not None:
                        legacy = _legacy(logprobs, choice.offset)
                        choice.offset += sum(len(t.token) for t in logprobs)
                    reason = None if isinstance(delta, TextDelta) else choice.finish_reason
                    if not text and legacy is None and reason is None:
                        continue
                    yield self._chunk(run, [CompletionChoice(at, text, legacy, reason)])
            except GatewayError as exc:
                self._finish(run, exc)
                done = True
                yield b"data: " + _json.encode(p.error_response(exc)) + b"\n\n"
                yield DONE
                return
            self._finish(run)
            done = True
            if include_usage:
                yield self._chunk(run, [], usage=_usage(run))
            yield DONE
        finally:
            # reached on completion and on a client disconnect (the stream is cancelled)
            run.cancel.set()
            await close_shielded(deltas)
            if not done:
                log.info("http_stream_abandoned", completion_id=run.completion_id)
                run.trace.root.set_attribute("visiongate.abandoned", True)
                run.trace.root.end()

    def _chunk(
        self, run: _Run, choices: list[CompletionChoice], *, usage: CompletionUsage | None = None
    ) -> bytes:
        chunk = Completion(
            id=run.completion_id,
            created=run.created,
            model=run.model,
            choices=choices,
            system_fingerprint=self._fingerprint(),
            usage=usage,
        )
        return b"data: " + _json.encode(chunk) + b"\n\n"

    def _finish(self, run: _Run, error: GatewayError | None = None) -> None:
        """Close the trace and record the response's metrics, as chat does."""
        usage = _usage(run)
        first = run.results[0] if run.results else None
        incomplete = any(c.finish_reason == "length" for c in run.choices)
        status = "failed" if error else ("incomplete" if incomplete else "completed")
        run.trace.finish(
            Finished(
                run.completion_id,
                "",
                status,
                "",
                error=error,
                input_tokens=usage.prompt_tokens,
                text_tokens=usage.prompt_tokens,
                output_tokens=usage.completion_tokens,
                cached_tokens=usage.prompt_tokens_details.cached_tokens,
                timings={
                    "queue_ms": first.queue_ms if first else 0.0,
                    "prefill_ms": first.prefill_ms if first else 0.0,
                    "decode_ms": first.decode_ms if first else 0.0,
                    "ttft_ms": run.ttft_ms,
                    "total_ms": _ms(run.received),
                },
            ),
            stream_start_ns=run.first_ns,
        )
        if error is None:
            log.info(
                "http_completion",
                completion_id=run.completion_id,
                api="completions",
                prompts=len(run.prompts),
                status=status,
                cached_tokens=usage.prompt_tokens_details.cached_tokens,
            )

    def _fingerprint(self) -> str:
        return "fp_" + self.state.require().vision.fingerprint[:12]


def _invalid(message: str, param: str) -> GatewayError:
    return GatewayError("invalid_request", message, param=param)


def _prompts(
    prompt: str | list[Any], limits: RequestLimits, vocab_size: int | None
) -> list[str | tuple[int, ...]]:
    """The request's prompts: a text, a list of token ids, or a list of texts and token-id
    lists (evaluation harnesses send ids); ids are checked against the model's vocabulary."""
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
        wheres = ["prompt"]
    elif prompt and not isinstance(prompt[0], (str, list)):  # [1, 2, 3]: one token prompt
        prompts, wheres = [prompt], ["prompt"]
    else:
        prompts = prompt
        wheres = [f"prompt[{i}]" for i in range(len(prompt))]
    if not prompts:
        raise _invalid("prompt must hold at least one prompt", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise _invalid(f"prompt holds at most {MAX_PROMPTS} prompts", "prompt")
    out: list[str | tuple[int, ...]] = []
    for value, where in zip(prompts, wheres, strict=True):
        if isinstance(value, list):
            out.append(check_prompt_tokens(value, vocab_size, limits, where))
            continue
        if not isinstance(value, str):
            raise _invalid(
                "a prompt is a string or a list of token ids; prompt is a string, a list of "
                "token ids, or a list of those",
                where,
            )
        if not value:
            raise _invalid("a prompt must not be empty", where)
        out.append(check_text(value, limits, where))
    return out


def _vocab_size(engine: Engine) -> int | None:
    """How many token ids the served model's tokenizer has (None: not known here, as with an
    upstream engine, which checks them itself)."""
    tokenizer = getattr(engine, "tokenizer", None)
    return len(tokenizer) if tokenizer is not None else None


def _check_unsupported(request: CompletionRequest, n: int) -> None:
    if request.suffix:
        raise _invalid("suffix (inserting text) is not supported", "suffix")
    if request.best_of is not None and request.best_of != n:
        raise _invalid("best_of is not supported (unless it equals n)", "best_of")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(request, name):
            raise _invalid(f"{name} is not supported; leave it at 0", name)
    if request.logit_bias:
        raise _invalid("logit_bias is not supported", "logit_bias")
    if request.stream_options is not None and not request.stream:
        raise _invalid("stream_options is only allowed when stream is true", "stream_options")


def _legacy(tokens: list[TokenLogprob], start: int) -> LegacyLogprobs:
    """Log-probabilities in the legacy layout; offsets count from `start` in the choice's text."""
    offsets: list[int] = []
    at = start
    for token in tokens:
        offsets.append(at)
        at += len(token.token)
    return LegacyLogprobs(
        tokens=[t.token for t in tokens],
        token_logprobs=[t.logprob for t in tokens],
        # the most likely tokens and the sampled one, as OpenAI's legacy format has them
        top_logprobs=[{**{a: lp for a, lp, _ in t.top}, t.token: t.logprob} for t in tokens],
        text_offset=offsets,
    )


def _usage(run: _Run) -> CompletionUsage:
    # every choice of a prompt reports the prompt: count it once, from its first choice
    prompts = [r for r in run.results if r.index == 0]
    prompt_tokens = sum(r.input_tokens for r in prompts)
    completion_tokens = sum(r.output_tokens for r in run.results)
    return CompletionUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=p.PromptTokensDetails(
            cached_tokens=sum(r.cached_tokens for r in prompts)
        ),
    )


_END = object()


async def _generate_all(
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
        except EngineBusy as exc:  # the engine's queue is full
            queue.put_nowait(
                (index, GatewayError("busy", str(exc), retry_after_s=exc.retry_after_s))
            )
        except EngineError as exc:
            code = exc.code if exc.code in ERROR_CODES else "engine_error"
            queue.put_nowait((index, GatewayError(code, str(exc))))
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


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 3)


def _never(_item: object) -> bool:
    return False  # the stream goes on after its first text
