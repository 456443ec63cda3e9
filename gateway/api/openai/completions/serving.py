"""Serving the legacy `POST /v1/completions`: plain-text prompts, no chat template, no session.

Evaluation harnesses speak this API. Each prompt, a text or a list of token ids, goes to the
engine as it is (`GenerationRequest.raw_prompt`). It fills in the serving base every OpenAI API
shares (`gateway.api.openai.serving`), so it is admitted as chat is (the key's rate limit, its
token limits' reservation, its cap on responses in flight, each refused with the same code),
with the same fair share of the engine (`cache_salt` is the API key's owner id, which also
scopes prefix caching) and the same trace and response metrics. A list of prompts gives `n`
choices per prompt, choice `i * n + j` being prompt i's j-th. `logprobs` (0..5) come in the
legacy layout: `tokens`, `token_logprobs`, `top_logprobs` as {token: logprob} (the k most likely
and the sampled token) and `text_offset`. `echo` puts the prompt before the answer; with
`logprobs` it is refused, since the prompt's own log-probabilities are not computed. Without
`temperature` the answer is greedy, as chat's is by default; `max_tokens` defaults to 16, as
OpenAI's does. As in chat, an answer starts only at the first text (or the end), so a failure
before any output gets its HTTP status, and a client that disconnects cancels generation.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import structlog

from gateway.api.http.event_streams import close_shielded, replay
from gateway.api.openai.chat import protocol as p
from gateway.api.openai.completions.protocol import (
    Completion,
    CompletionChoice,
    CompletionRequest,
    CompletionUsage,
    LegacyLogprobs,
)
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
from gateway.chat.events import ChoiceEnd, Finished, ResponseOptions, TextChunk
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
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from gateway.chat.generation_stream import RawEvent
    from gateway.chat.vision_resolver import EncodePermit
    from gateway.engine.interface import Engine, TokenLogprob

__all__ = ("CompletionServing",)

log = structlog.get_logger("visiongate.http")

_json = msgspec.json.Encoder()
DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions
MAX_LEGACY_LOGPROBS = 5
MAX_PROMPTS = 64  # prompts in one request


@dataclass(slots=True)
class _Choice:
    """One choice as it is built: its text, its tokens' log-probabilities, how it ended."""

    prefix: str  # the echoed prompt, or ""
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    offset: int = 0  # text_offset of its next token (the echoed prompt counts)
    finish_reason: Literal["stop", "length"] | None = None
    echoed: bool = False


@dataclass(frozen=True, slots=True)
class _Run:
    """A request admitted and ready to run: built once by `prepare`; only its choices grow."""

    request: CompletionRequest
    owner: str
    prompts: list[str | tuple[int, ...]]
    options: ResponseOptions
    created: int
    model: str
    choices: list[_Choice]
    permit: EncodePermit  # no images: holds no slot, closed as the answer opens

    @property
    def completion_id(self) -> str:
        return self.options.response_id

    @property
    def session_header(self) -> None:
        return None  # no session


class CompletionServing(OpenAIServing[_Run, Completion]):
    """Legacy completions through `ChatService.respond_raw`: the service runs the prompts (at
    most a few in the engine at once), keeps the trace and the response metrics; this builds
    the legacy answer from its events."""

    async def create(
        self, request: CompletionRequest, *, owner: str
    ) -> Completion | EventStream | p.ErrorResponse:
        return await self.serve(lambda: self.prepare(request, owner))

    async def prepare(self, request: CompletionRequest, owner: str) -> _Run:
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
        options = ResponseOptions(
            response_id=f"cmpl-{secrets.token_hex(12)}",
            api="completions",
            max_output_tokens=max_tokens or DEFAULT_MAX_TOKENS,
            temperature=request.temperature,  # None: greedy, as chat's default
            top_p=request.top_p,
            seed=request.seed,
            stop=check_stop(request.stop),
            logprobs=logprobs,
            n=n,
            # the prefix-cache namespace of the API key, narrowed by the client's salt
            cache_salt=check_cache_salt(request.cache_salt),
            store=False,
        )
        # no images: the admission is the key's rate limit (and its token limits' room)
        permit, _ = await self.admit(owner=owner, inline={}, refs={}, build=_nothing)
        return _Run(
            request=request,
            owner=owner,
            prompts=prompts,
            options=options,
            created=int(time.time()),
            model=model,
            choices=[
                _Choice(prefix=prompt, offset=len(prompt))
                if request.echo and isinstance(prompt, str)
                else _Choice(prefix="")
                for prompt in prompts
                for _ in range(n)
            ],
            permit=permit,
        )

    def respond(self, run: _Run, received: float) -> AsyncIterator[RawEvent]:
        return self.state.require().service.respond_raw(
            run.prompts, run.options, owner=run.owner, received_at=received
        )

    async def complete(self, run: _Run, opened: Opened[RawEvent]) -> Completion | p.ErrorResponse:
        finished = await read_to_end(
            opened, run.options.cancel, lambda event: self._take(run, event)
        )
        if finished is None or finished.status == "failed":
            return p.error_response(failure_of(finished))
        self._logged(run, finished)
        return Completion(
            id=run.completion_id,
            created=run.created,
            model=run.model,
            choices=[
                CompletionChoice(
                    index=i,
                    text=c.prefix + "".join(c.text),
                    logprobs=_legacy(c.logprobs, len(c.prefix))
                    if run.options.logprobs is not None
                    else None,
                    finish_reason=c.finish_reason or "stop",
                )
                for i, c in enumerate(run.choices)
            ],
            system_fingerprint=fingerprint(self.state),
            usage=_usage(finished),
        )

    def _take(self, run: _Run, event: RawEvent) -> tuple[_Choice, int, list[TokenLogprob]] | None:
        """Add one event to its choice; (the choice, its index, the event's log-probabilities),
        or None for an event of no choice (the start, the end)."""
        if isinstance(event, TextChunk):
            choice = run.choices[event.index]
            choice.text.append(event.text)
            choice.logprobs.extend(event.logprobs)
            return choice, event.index, list(event.logprobs)
        if isinstance(event, ChoiceEnd):
            choice = run.choices[event.index]
            choice.finish_reason = "length" if event.reason == "max_output_tokens" else "stop"
            choice.logprobs.extend(event.logprobs)
            return choice, event.index, list(event.logprobs)
        return None

    async def stream(
        self, run: _Run, opened: Opened[RawEvent], budget: RedisBudget
    ) -> AsyncIterator[bytes]:
        use_request_budget(budget)  # the answer is still this request's: so is its bound
        first, events = opened.first, opened.events
        include_usage = bool(
            run.request.stream_options and run.request.stream_options.include_usage
        )
        legacy_logprobs = run.options.logprobs is not None
        finished: Finished | None = None
        try:
            async for event in replay(first, events, is_finished):
                if isinstance(event, Finished):
                    finished = event
                    continue
                taken = self._take(run, event)
                if taken is None:
                    continue
                choice, at, logprobs = taken
                text = event.text if isinstance(event, TextChunk) else ""
                if not choice.echoed:
                    text, choice.echoed = choice.prefix + text, True
                legacy = None
                if legacy_logprobs:
                    legacy = _legacy(logprobs, choice.offset)
                    choice.offset += sum(len(t.token) for t in logprobs)
                reason = choice.finish_reason if isinstance(event, ChoiceEnd) else None
                if not text and legacy is None and reason is None:
                    continue
                yield self._chunk(run, [CompletionChoice(at, text, legacy, reason)])
            if finished is None or finished.status == "failed":
                yield b"data: " + _json.encode(p.error_response(failure_of(finished))) + b"\n\n"
            else:
                self._logged(run, finished)
                if include_usage:
                    yield self._chunk(run, [], usage=_usage(finished))
            yield DONE
        finally:
            # reached on completion and on a client disconnect (the stream is cancelled)
            run.options.cancel.set()
            if finished is None:
                log.info("http_stream_abandoned", completion_id=run.completion_id)
            await close_shielded(events)

    def _chunk(
        self, run: _Run, choices: list[CompletionChoice], *, usage: CompletionUsage | None = None
    ) -> bytes:
        chunk = Completion(
            id=run.completion_id,
            created=run.created,
            model=run.model,
            choices=choices,
            system_fingerprint=fingerprint(self.state),
            usage=usage,
        )
        return b"data: " + _json.encode(chunk) + b"\n\n"

    def _logged(self, run: _Run, finished: Finished) -> None:
        log.info(
            "http_completion",
            completion_id=run.completion_id,
            api="completions",
            prompts=len(run.prompts),
            status=finished.status,
            cached_tokens=finished.cached_tokens,
        )


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
    return engine.capabilities.vocab_size


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


def _usage(finished: Finished) -> CompletionUsage:
    """The service's usage (each prompt counted once, however many choices it has)."""
    return CompletionUsage(
        prompt_tokens=finished.input_tokens,
        completion_tokens=finished.output_tokens,
        total_tokens=finished.input_tokens + finished.output_tokens,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=finished.cached_tokens),
    )


async def _nothing() -> None:
    """A completion's session step: it has no session."""
