"""The `openai` engine: generation on N OpenAI-compatible replicas of one model.

`OpenAIEngine` speaks the `Engine` protocol over vLLM, SGLang, `trtllm-serve` or another
visiongate. Each request is one streamed completion on one replica, chosen by session affinity
with bounded load (`gateway.engine.upstream.routing`); a replica that fails before the first
text is replaced by the next in the order, so no text is ever sent twice. The engine keeps no
KV of its own: each replica's prefix cache holds what it served, and routing sends a
conversation back to the replica that has it.

The request bodies (chat completions, or completions for a raw prompt; images as data URLs or
embeds) are `gateway.engine.upstream.upstream_bodies`'s; the replicas' start, health and probing
are `gateway.engine.upstream.replicas`'s; reading the stream is `gateway.engine.upstream.sse`'s.

The stream's chunks become `TextDelta`s (by choice index, with log-probabilities), then one
`GenerationResult` per choice: finish reason "stop" or "length" (anything else reads as
"stop"), prompt / cached / image tokens from the final usage chunk, output tokens from it too
(split between choices by the chunks each streamed). Timings: `queue_ms` is everything before
the request went out (routing, failed attempts, connecting), `ttft_ms` = `prefill_ms` the
upstream's time from the request sent to the first text, `decode_ms` the rest.

Failures: before the first text, a refused or dropped connection, a timeout (connecting past
`connect_timeout_s`, or no byte for `first_token_timeout_s`, which also bounds a silence
between chunks) or an HTTP 5xx marks the replica down and tries the next; a 429 tries the next
without marking it. When every replica answered 429 the engine raises `EngineBusy` (its
Retry-After passed on), otherwise `EngineError("upstream_error")`. A 400 is the client's:
"context_length_exceeded" when the upstream says so, else "invalid_request" with its message
(saying so when the request carried an output grammar, which a replica may not take);
a 413 is "input_too_large"; 401, 403 and 404 mean the gateway's configuration is wrong
("upstream_error", logged). After the first text any failure ends the stream with
`EngineError("upstream_error")`.

Constrained output (`sampling.grammar`: tools, response formats) goes only to replicas that
showed they apply the gateway's grammars (`gateway.engine.upstream.grammar_probe`, asked once
per replica); `warm_up` prefills a session's conversation on the replica of its next turn with
a one-token request (embeds mode: the session warm-up passes no image bytes).

Cancellation (`request.cancel`, or closing the iterator) closes the upstream response at once,
which makes the replica abort the request: the event is checked at every chunk and, while no
chunk arrives, by one watcher that polls every in-flight request's event every 20 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import httpx
import structlog
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.engine.interface import (
    CHARS_PER_TOKEN,
    Delta,
    EngineBusy,
    EngineCapabilities,
    EngineError,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    ImageInputKind,
    SamplingParams,
    TextDelta,
    WarmUpResult,
)
from gateway.engine.upstream.endpoints import Upstream, parse_upstreams
from gateway.engine.upstream.grammar_probe import GrammarSupport, probe_grammar
from gateway.engine.upstream.replicas import (
    ReplicaPool,
    failure_reason,
    load_tokenizer,
    text_hidden_size,
)
from gateway.engine.upstream.routing import Replica
from gateway.engine.upstream.sse import drain_reader, read_events
from gateway.engine.upstream.upstream_bodies import request_body
from gateway.engine.upstream.wire import (
    CANCELLED,
    DONE,
    EOF,
    ImageParts,
    Retry,
    Run,
    StreamBroken,
    UpstreamStatus,
    json_encoder,
)
from gateway.protocol.errors import clip

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

__all__ = ("OpenAIEngine",)

log = structlog.get_logger(__name__)

CANCEL_POLL_S = 0.02  # how often the watcher looks at cancel events while no chunk arrives
RENDER_OFF_LOOP_BYTES = 1 << 20  # new images past this are rendered on a worker thread
# what an upstream's 400 says when the prompt does not fit (vLLM, SGLang, TensorRT-LLM, OpenAI)
_CONTEXT_MESSAGE = re.compile(
    r"context[ _-]?(length|window)|maximum (model |context )?length|max_model_len|"
    r"longer than the (model's )?(maximum|context)|too many tokens",
    re.IGNORECASE,
)
_propagator = TraceContextTextMapPropagator()


class OpenAIEngine:
    """`Engine` over OpenAI-compatible replicas of one model (see the module docstring)."""

    def __init__(
        self,
        upstreams: Sequence[Upstream],
        *,
        image_input: ImageInputKind = "bytes",
        model_id: str | None = None,
        context_tokens: int = 0,
        hidden_size: int = 0,
        tokenizer_path: str | None = None,
        checkpoint_name: str | None = None,
        health_interval_s: float = 2.0,
        connect_timeout_s: float = 5.0,
        first_token_timeout_s: float = 120.0,
        load_factor: float = 1.25,
        start_timeout_s: float = 120.0,
        image_tokens_estimate: int = 1024,
        cache_salt: bool = True,
    ) -> None:
        if image_input not in ("bytes", "embeds"):
            raise ValueError(f"image_input must be bytes or embeds, got {image_input!r}")
        if image_input == "embeds" and not checkpoint_name:
            raise ValueError("embeds mode needs the checkpoint's name (the encoder's model_path)")
        self.image_input: ImageInputKind = image_input
        self._pool = ReplicaPool(
            upstreams,
            image_input=image_input,
            model_id=model_id,
            context_tokens=context_tokens,
            checkpoint_name=checkpoint_name,
            health_interval_s=health_interval_s,
            health_timeout=httpx.Timeout(max(1.0, min(connect_timeout_s, 5.0))),
            start_timeout_s=start_timeout_s,
            load_factor=load_factor,
        )
        self._replicas = self._pool.replicas
        self._router = self._pool.router
        self.hidden_size = hidden_size
        self._tokenizer_path = tokenizer_path
        self._tokenizer: Any = None
        # what the gateway counts an image sent as bytes as, fitting a prompt to the context
        self.image_tokens_estimate = image_tokens_estimate if image_input == "bytes" else 0
        # a warm-up sends the session's images as embeds: the session warm-up has no bytes
        self._capabilities = EngineCapabilities(
            image_input=image_input,
            warm_up=image_input == "embeds",
            image_tokens_estimate=self.image_tokens_estimate,
        )
        self._cache_salt = cache_salt
        self._timeout = httpx.Timeout(
            connect=connect_timeout_s,
            read=first_token_timeout_s,
            write=connect_timeout_s,
            pool=connect_timeout_s,
        )
        self._client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._runs: set[Run] = set()
        self._draining: set[asyncio.Task[None]] = set()  # readers finishing a complete body
        self._images = ImageParts()
        # whether each replica applies output grammars (`grammar_probe`), by name; and the
        # probes in flight, so concurrent constrained requests ask a replica once
        self._grammars: dict[str, GrammarSupport] = {}
        self._grammar_probes: dict[str, asyncio.Task[GrammarSupport]] = {}
        self._warming: set[str] = set()  # replicas running a KV warm-up now
        self._started = False
        self._tracer: Tracer = trace.get_tracer("visiongate.upstream")
        self._metrics: Any = None

    @classmethod
    def from_settings(cls, settings: Any) -> OpenAIEngine:
        upstreams = parse_upstreams(settings.upstreams)
        if settings.upstream_model:
            upstreams = [replace(u, model=u.model or settings.upstream_model) for u in upstreams]
        tokenizer_path = checkpoint_name = None
        hidden_size = 0
        if settings.model_path:
            tokenizer_path = settings.model_path
            checkpoint_name = os.path.basename(os.path.normpath(settings.model_path))
            hidden_size = text_hidden_size(settings.model_path)
        return cls(
            upstreams,
            image_input="embeds" if settings.upstream_images == "embeds" else "bytes",
            context_tokens=settings.upstream_context_tokens,
            image_tokens_estimate=settings.upstream_image_tokens,
            cache_salt=settings.upstream_cache_salt,
            hidden_size=hidden_size,
            tokenizer_path=tokenizer_path,
            checkpoint_name=checkpoint_name,
        )

    # -- lifecycle (the replicas': `ReplicaPool`) -------------------------------------------

    @property
    def model_id(self) -> str:
        """The model name the replicas serve (configured, or the first to answer's)."""
        return self._pool.model_id

    @property
    def context_tokens(self) -> int:
        """The context every replica can take (see `ReplicaPool`)."""
        return self._pool.context_tokens

    @property
    def ready(self) -> bool:
        return self._started and any(r.healthy for r in self._replicas)

    @property
    def capabilities(self) -> EngineCapabilities:
        """Images as bytes or embeds (as configured); warm-ups in embeds mode only; an
        estimate of an image's tokens in bytes mode. Token ids are the replicas' to check."""
        return self._capabilities

    def bind_telemetry(self, telemetry: Any) -> None:
        """Per-replica metrics (`telemetry.metrics`) and one span per attempt (its tracer)."""
        self._tracer = telemetry.tracer
        self._metrics = telemetry.metrics
        self._metrics.observe_upstreams(
            in_flight=lambda: {r.name: r.in_flight for r in self._replicas},
            healthy=lambda: {r.name: r.healthy for r in self._replicas},
        )

    async def start(self) -> None:
        """Ask every replica what it serves; at least one must answer within `start_timeout_s`
        (asked again every second until then). Starts the health loop."""
        if self._started:
            return
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=self._timeout,
                limits=httpx.Limits(
                    max_connections=4096, max_keepalive_connections=512, keepalive_expiry=30.0
                ),
                trust_env=False,  # replicas are addressed directly, never through a proxy
            )
        if self._tokenizer_path:
            self._tokenizer = await asyncio.to_thread(load_tokenizer, self._tokenizer_path)
        else:
            log.info(
                "upstream.token_count_estimated",
                why="no --model-path: prompt tokens are estimated as UTF-8 bytes / 3",
            )
        self._pool.client = self._client
        answered = await self._pool.start()
        self._started = True
        self._tasks = [
            asyncio.create_task(self._pool.health_loop(), name="upstream health"),
            asyncio.create_task(self._watch_cancels(), name="upstream cancels"),
        ]
        log.info(
            "upstream.started",
            model=self.model_id,
            replicas=[r.name for r in self._replicas],
            up=[r.name for r in answered],
            context_tokens=self.context_tokens,
            image_input=self.image_input,
        )

    async def aclose(self) -> None:
        for task in (*self._tasks, *self._draining):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._draining, return_exceptions=True)
        self._tasks = []
        self._started = False
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- what the gateway asks besides generation -------------------------------------------

    def count_tokens(self, text: str) -> int:
        """The checkpoint's own count with a tokenizer (`tokenizer_path`); else an estimate
        on the safe side (UTF-8 bytes / 3, rounded up: real tokenizers average more)."""
        if self._tokenizer is not None:
            return len(self._tokenizer.encode(text, add_special_tokens=False))
        return math.ceil(len(text.encode()) / CHARS_PER_TOKEN)

    def forget(self, kv_key: str) -> None:
        """Nothing to drop: the replicas' prefix caches age out on their own."""

    def stats(self) -> EngineStats:
        return EngineStats(running=self._router.in_flight())

    # -- KV warm-up --------------------------------------------------------------------------

    async def warm_up(self, request: GenerationRequest) -> WarmUpResult:
        """Prefill a session's conversation into the prefix cache of the replica its next turn
        goes to: the prompt as a one-token request, routed and salted as that turn will be
        (the session's `kv_key`, the key's `cache_salt`), its token discarded. The replica
        then finds the conversation's whole blocks cached when the question comes.

        Lowest priority, as far as the gateway can tell: a warm-up goes only to a replica with
        nothing of this gateway's in flight, one at a time per replica, never to another
        replica, and is dropped otherwise ("dropped", with the reason); the replica itself has
        no priority to give it (vLLM's needs `--scheduling-policy priority`). Images must be
        embeds (the session warm-up calls this in embeds mode only)."""
        if not self._started or self._client is None:
            return WarmUpResult("failed", reason="engine not started")
        if request.kv_key is None:
            return WarmUpResult("failed", reason="a warm-up needs the session's kv_key")
        order = self._pool.candidates(request)
        if not order:
            return WarmUpResult("dropped", reason="no replica is up")
        replica = order[0]
        if replica.in_flight or replica.name in self._warming:
            return WarmUpResult("dropped", reason=f"{replica.name} is busy")
        one_token = GenerationRequest(
            request_id=request.request_id,
            messages=request.messages,
            sampling=SamplingParams(max_output_tokens=1),
            kv_key=request.kv_key,
            cancel=request.cancel,
            cache_salt=request.cache_salt,
            owner=request.owner,
        )
        started = time.perf_counter()
        self._warming.add(replica.name)
        try:
            results = [d async for d in self.generate(one_token, only=replica)]
        except EngineBusy:
            return WarmUpResult("dropped", reason=f"{replica.name} is busy (HTTP 429)")
        except EngineError as exc:
            return WarmUpResult("failed", reason=str(exc))
        finally:
            self._warming.discard(replica.name)
        ended = [r for r in results if isinstance(r, GenerationResult)]
        if not ended or ended[0].finish_reason == "cancelled":
            return WarmUpResult("dropped", reason="cancelled")
        result = ended[0]
        return WarmUpResult(
            "warmed",
            positions=result.input_tokens,
            computed=max(result.input_tokens - result.cached_tokens, 0),
            queue_ms=result.queue_ms,
            prefill_ms=round((time.perf_counter() - started) * 1e3 - result.queue_ms, 3),
        )

    async def _watch_cancels(self) -> None:
        """Wakes a request waiting for a chunk when its cancel event is set."""
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            for run in self._runs:
                if run.cancel.is_set() and run.queue is not None:
                    run.queue.put_nowait(CANCELLED)

    # -- generation -------------------------------------------------------------------------

    def _body(self, request: GenerationRequest) -> tuple[str, dict[str, Any]]:
        return request_body(request, self._images, self.image_input, salted=self._cache_salt)

    async def generate(
        self, request: GenerationRequest, *, only: Replica | None = None
    ) -> AsyncIterator[Delta]:
        """The `Engine` protocol's; `only`: on that replica alone, no failover (a warm-up)."""
        if not self._started or self._client is None:
            raise EngineError("the upstream engine is not started", code="upstream_error")
        run = Run(request)
        if self._images.missing_bytes(request) > RENDER_OFF_LOOP_BYTES:
            path, body = await asyncio.to_thread(self._body, request)  # base64 of megabytes
        else:
            path, body = self._body(request)
        order = [only] if only is not None else self._pool.candidates(request)
        if request.sampling.grammar is not None:
            order = await self._applying_grammars(order)
        failures: list[str] = []
        busy_after: list[float] = []
        self._runs.add(run)
        try:
            for attempt, replica in enumerate(order, 1):
                if run.cancel.is_set():
                    break
                last = attempt == len(order)
                try:
                    async with contextlib.aclosing(
                        self._attempt(replica, attempt, path, body, run, last)
                    ) as stream:
                        async for delta in stream:
                            yield delta
                    break
                except Retry as exc:
                    failures.append(f"{replica.name}: {exc}")
                    if exc.busy_after is not None:
                        busy_after.append(exc.busy_after)
                    if not last:
                        log.warning(
                            "upstream.failover",
                            upstream=replica.name,
                            attempt=attempt,
                            reason=str(exc),
                            request_id=request.request_id,
                        )
            else:
                if len(busy_after) == len(order):
                    raise EngineBusy(
                        "every upstream replica is busy (HTTP 429)",
                        retry_after_s=min(busy_after) if busy_after else 1.0,
                    )
                log.error(
                    "upstream.unanswered",
                    request_id=request.request_id,
                    attempts=len(failures),
                    failures=failures,
                )
                # the replicas' names and their error bodies stay in the log
                raise EngineError(
                    f"no upstream replica could answer ({len(failures)} tried)",
                    code="upstream_error",
                )
            if run.cancel.is_set() and not run.ended:
                for result in run.results(cancelled=True):
                    yield result
                return
            aborted = run.aborted()
            if aborted is not None and not run.cancel.is_set():
                raise EngineError(
                    f"the upstream replica cut the answer short (finish reason {clip(aborted)})",
                    code="upstream_error",
                )
            for result in run.results():
                yield result
        finally:
            self._runs.discard(run)

    async def _applying_grammars(self, order: list[Replica]) -> list[Replica]:
        """`order` less the replicas known not to apply output grammars (each asked once,
        `grammar_probe`); `invalid_request` when that leaves none."""
        unknown = [r for r in order if self._grammars.get(r.name, "unknown") == "unknown"]
        if unknown:
            await asyncio.gather(*(self._grammar_support(r) for r in unknown))
        able = [r for r in order if self._grammars.get(r.name) != "no"]
        if order and not able:
            raise EngineError(
                "no upstream replica applies the output grammars that tools and response "
                "formats need (vLLM does with --structured-outputs-config "
                '\'{"backend": "guidance"}\')',
                code="invalid_request",
            )
        return able

    async def _grammar_support(self, replica: Replica) -> GrammarSupport:
        task = self._grammar_probes.get(replica.name)
        if task is None:
            task = asyncio.create_task(self._probe_grammar(replica))
            self._grammar_probes[replica.name] = task
            task.add_done_callback(lambda _: self._grammar_probes.pop(replica.name, None))
        return await asyncio.shield(task)

    async def _probe_grammar(self, replica: Replica) -> GrammarSupport:
        assert self._client is not None
        support, why = await probe_grammar(
            self._client,
            replica,
            replica.model or self.model_id,
            self._pool.headers(replica),
            httpx.Timeout(self._timeout.connect or 5.0, read=30.0),
        )
        self._grammars[replica.name] = support
        if support == "no":
            log.error(
                "upstream.grammar_unsupported",
                upstream=replica.name,
                reason=why,
                why="tools and response formats are not sent to this replica; vLLM applies "
                'them with --structured-outputs-config \'{"backend": "guidance"}\'',
            )
        else:
            log.info("upstream.grammar_probe", upstream=replica.name, support=support, reason=why)
        return support

    async def _attempt(
        self,
        replica: Replica,
        attempt: int,
        path: str,
        body: dict[str, Any],
        run: Run,
        last: bool,
    ) -> AsyncIterator[TextDelta]:
        """One try on one replica: its deltas; `Retry` when it failed before any text."""
        span = self._tracer.start_span(
            "upstream.request",
            kind=SpanKind.CLIENT,
            attributes={
                "visiongate.upstream.name": replica.name,
                "visiongate.upstream.attempt": attempt,
            },
        )
        headers = self._pool.headers(replica)
        headers["content-type"] = "application/json"
        _propagator.inject(headers, context=trace.set_span_in_context(span))
        payload = json_encoder.encode({"model": replica.model or self.model_id, **body})
        queue: asyncio.Queue[Any] = asyncio.Queue()
        run.queue = queue
        run.sent_at = None
        replica.in_flight += 1
        reader = asyncio.create_task(
            read_events(
                self._client,
                f"{replica.upstream.base_url}{path}",
                payload,
                headers,
                queue,
                run,
                span,
            )
        )
        outcome = "error"
        try:
            while True:
                item = await queue.get()
                if item is DONE or item is EOF:
                    if not all(run.finish):
                        raise StreamBroken("the stream ended before every choice finished")
                    run.ended = True
                    outcome = "ok"
                    return
                if item is CANCELLED or run.cancel.is_set():
                    outcome = "cancelled"
                    return
                if isinstance(item, BaseException):
                    raise item
                for delta in run.absorb(item):
                    yield delta
                if run.overrun:  # past max_tokens: the upstream's stream is closed here
                    run.ended = True
                    outcome = "ok"
                    return
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "cancelled"  # the caller went away
            raise
        except UpstreamStatus as exc:
            if run.emitted:
                raise _mid_answer(replica, exc) from None
            retried = exc.status >= 500 or exc.status == 408
            outcome = (
                "busy" if exc.status == 429 else "failover" if retried and not last else "error"
            )
            self._on_status(replica, exc, grammar=run.constrained)
        except Exception as exc:  # transport errors, a broken stream, bad JSON
            if run.emitted:
                raise _mid_answer(replica, exc) from None
            self._pool.set_health(replica, False, failure_reason(exc))
            outcome = "error" if last else "failover"
            raise Retry(failure_reason(exc)) from None
        finally:
            if outcome == "error" and run.cancel.is_set():
                outcome = "cancelled"
            if outcome == "ok" and not reader.done() and not run.overrun:
                # it reads the body's last bytes, so the connection goes back to the pool;
                # a body that does not end soon is cut (its connection closed)
                drain = asyncio.create_task(drain_reader(reader))
                self._draining.add(drain)
                drain.add_done_callback(self._draining.discard)
            else:  # closing the response mid-stream makes the replica abort the request
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader
            run.queue = None
            replica.in_flight -= 1
            span.set_attribute("visiongate.upstream.outcome", outcome)
            if outcome in ("error", "failover", "busy"):
                span.set_status(StatusCode.ERROR, outcome)
            span.end()
            if self._metrics is not None:
                ttft_s = None
                if outcome == "ok" and run.first_at is not None and run.sent_at is not None:
                    ttft_s = run.first_at - run.sent_at
                self._metrics.record_upstream_attempt(
                    upstream=replica.name, outcome=outcome, ttft_s=ttft_s
                )

    def _on_status(self, replica: Replica, exc: UpstreamStatus, grammar: bool = False) -> None:
        """Raise what a non-200 answer means (see the module docstring)."""
        status = exc.status
        if status == 429:
            raise Retry("HTTP 429", busy_after=exc.retry_after or 1.0)
        if status >= 500 or status == 408:
            if status >= 500:
                self._pool.set_health(replica, False, f"HTTP {status}")
            raise Retry(f"HTTP {status}: {clip(exc.text)}")
        if status in (400, 422):
            if exc.code == "context_length_exceeded" or _CONTEXT_MESSAGE.search(exc.text):
                raise EngineError(clip(exc.text, 400), code="context_length_exceeded")
            refused = clip(exc.text, 400) or "refused"
            if grammar:
                refused = (
                    f"the upstream replica refused the request with its output grammar: {refused}"
                )
            raise EngineError(refused, code="invalid_request")
        if status == 413:
            raise EngineError(clip(exc.text, 400) or "too large", code="input_too_large")
        log.error(
            "upstream.refused",
            upstream=replica.name,
            status=status,
            message=clip(exc.text),
            why="the gateway's upstream configuration (URL, model, API key) is wrong",
        )
        raise EngineError(
            f"the upstream replica refused the gateway's request (HTTP {status})",
            code="upstream_error",
        )


def _mid_answer(replica: Replica, exc: BaseException) -> EngineError:
    """What a failure after the first text becomes (the replica's words stay in the log)."""
    log.warning("upstream.failed_mid_answer", upstream=replica.name, reason=failure_reason(exc))
    return EngineError("the upstream replica failed mid-answer", code="upstream_error")
