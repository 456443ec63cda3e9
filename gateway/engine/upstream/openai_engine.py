"""The `openai` engine: generation on N OpenAI-compatible replicas of one model.

`OpenAIEngine` speaks the `Engine` protocol over vLLM, SGLang, `trtllm-serve` or another
visiongate. Each request is one streamed completion on one replica, chosen by session affinity
with bounded load (`gateway.engine.upstream.routing`); a replica that fails before the first
text is replaced by the next in the order, so no text is ever sent twice. The engine keeps no
KV of its own: each replica's prefix cache holds what it served, and routing sends a
conversation back to the replica that has it.

The request (`POST {base_url}/v1/chat/completions`, Bearer key when the replica has one)::

    {"model": NAME, "stream": true, "stream_options": {"include_usage": true},
     "messages": [{"role": "system" | "user" | "assistant", "content": CONTENT}, ...],
     "max_tokens": M, "max_completion_tokens": M, "temperature": T, "top_p": P, "n": N,
     "seed": S,                              # when set
     "stop": [...],                          # when set
     "logprobs": true, "top_logprobs": K}    # when log-probabilities are asked for

CONTENT is a string (the message's text parts joined by newlines) when a message has no
image, else a list of parts in order: `{"type": "text", "text": ...}` and, per image,

- bytes mode (`image_input == "bytes"`, settings `upstream_images = "data_url"`)::

    {"type": "image_url", "uuid": DIGEST,
     "image_url": {"url": "data:<mime>;base64,<bytes>", "content_hash": "sha256:<hex>"}}

  DIGEST is the gateway's content id: vLLM keys its multimodal cache by the part's `uuid`
  (so a replica that saw the image skips decoding and encoding it); SGLang takes a caller's
  digest as `image_url.content_hash` ("sha256:" and the 64 hex digits of the bytes, which it
  checks), so that one is sent only when the content id is the bytes' own sha256 (not when
  images are private to each API key and the id is a per-key name). Other servers ignore
  both fields.

- embeds mode (`"embeds"`; vLLM started with `--enable-mm-embeds`)::

    {"type": "image_embeds", "uuid": "<fingerprint16>:<sha256>", "image_embeds": B64}

  B64 is the image's visual tokens [N, hidden] serialized as vLLM's own `tensor2base64`
  does (`torch.save` of the tensor, base64): the replica loads it with
  `torch.load(weights_only=True)`. For M-RoPE checkpoints (Qwen2-VL, Qwen2.5-VL) the part is
  the dict form vLLM documents, `"image_embeds": {"image_embeds": B64, "image_grid_thw":
  B64([[t, h, w]])}`, the grid in patches before the 2x2 merge. vLLM accepts image embeds in
  one message per request only; the upstream's 400 says so when a conversation has more.

A plain-text prompt (`raw_prompt`) goes to `/v1/completions` with `prompt` instead of
`messages` (and `logprobs: K`, the completions form).

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
"context_length_exceeded" when the upstream says so, else "invalid_request" with its message;
a 413 is "input_too_large"; 401, 403 and 404 mean the gateway's configuration is wrong
("upstream_error", logged). After the first text any failure ends the stream with
`EngineError("upstream_error")`.

Cancellation (`request.cancel`, or closing the iterator) closes the upstream response at once,
which makes the replica abort the request: the event is checked at every chunk and, while no
chunk arrives, by one watcher that polls every in-flight request's event every 20 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import httpx
import structlog
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.engine.interface import (
    Delta,
    EngineBusy,
    EngineError,
    EngineStats,
    GenerationRequest,
    ImageInput,
    ImageInputKind,
    TextDelta,
)
from gateway.engine.upstream.endpoints import Upstream, parse_upstreams
from gateway.engine.upstream.routing import Replica, Router, route_key
from gateway.engine.upstream.wire import (
    CANCELLED,
    DONE,
    EOF,
    ImageParts,
    Retry,
    Run,
    StreamBroken,
    UpstreamStatus,
    chunk_decoder,
    json_encoder,
    retry_after,
)
from gateway.protocol.errors import clip

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

__all__ = ("OpenAIEngine",)

log = structlog.get_logger(__name__)

DEFAULT_CONTEXT_TOKENS = 8192
START_RETRY_S = 1.0  # between rounds of GET /v1/models while no replica has answered
CANCEL_POLL_S = 0.02  # how often the watcher looks at cancel events while no chunk arrives
MAX_SSE_LINE_BYTES = 16 << 20  # one event line of the upstream's stream at most
DRAIN_S = 2.0  # reading a finished answer's body to its end, at most (then the connection goes)
RENDER_OFF_LOOP_BYTES = 1 << 20  # new images past this are rendered on a worker thread
# what an upstream's 400 says when the prompt does not fit (vLLM, SGLang, TensorRT-LLM, OpenAI)
_CONTEXT_MESSAGE = re.compile(
    r"context[ _-]?(length|window)|maximum (model |context )?length|max_model_len|"
    r"longer than the (model's )?(maximum|context)|too many tokens",
    re.IGNORECASE,
)
_propagator = TraceContextTextMapPropagator()


# ------------------------------------------------------------------------ the engine


class _Mismatch(Exception):
    """A replica serves another checkpoint than the gateway's encoder (embeds mode)."""


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
        self._replicas = [Replica(u) for u in upstreams]
        self._router = Router(self._replicas, load_factor=load_factor)
        self._model_id_arg = model_id
        self.model_id = model_id or next((r.model for r in self._replicas if r.model), "upstream")
        self._context_arg = context_tokens
        self.context_tokens = context_tokens or DEFAULT_CONTEXT_TOKENS
        self.hidden_size = hidden_size
        self._tokenizer_path = tokenizer_path
        self._tokenizer: Any = None
        self._checkpoint = checkpoint_name
        self._health_interval_s = health_interval_s
        self._start_timeout_s = start_timeout_s  # how long start() waits for a replica
        # what the gateway counts an image sent as bytes as, fitting a prompt to the context
        self.image_tokens_estimate = image_tokens_estimate if image_input == "bytes" else 0
        self._cache_salt = cache_salt
        self._timeout = httpx.Timeout(
            connect=connect_timeout_s,
            read=first_token_timeout_s,
            write=connect_timeout_s,
            pool=connect_timeout_s,
        )
        self._health_timeout = httpx.Timeout(max(1.0, min(connect_timeout_s, 5.0)))
        self._client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._runs: set[Run] = set()
        self._draining: set[asyncio.Task[None]] = set()  # readers finishing a complete body
        self._images = ImageParts()
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
            hidden_size = _text_hidden_size(settings.model_path)
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

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._started and any(r.healthy for r in self._replicas)

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
            self._tokenizer = await asyncio.to_thread(_load_tokenizer, self._tokenizer_path)
        else:
            log.info(
                "upstream.token_count_estimated",
                why="no --model-path: prompt tokens are estimated as UTF-8 bytes / 3",
            )
        # replicas often start with the gateway: wait for one to answer, up to a deadline
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            outcomes = await asyncio.gather(
                *(self._describe(r) for r in self._replicas), return_exceptions=True
            )
            answered_now = any(o is None or isinstance(o, _Mismatch) for o in outcomes)
            if answered_now or time.monotonic() >= deadline:
                break
            log.info(
                "upstream.waiting",
                replicas=[r.name for r in self._replicas],
                reason=_reason(outcomes[0]),
                seconds_left=round(deadline - time.monotonic()),
            )
            await asyncio.sleep(min(START_RETRY_S, max(deadline - time.monotonic(), 0.0)))
        mismatched = [
            f"{r.name}: {o}"
            for r, o in zip(self._replicas, outcomes, strict=True)
            if isinstance(o, _Mismatch)
        ]
        if mismatched:
            raise EngineError(
                "upstream_images=embeds needs every replica to serve the gateway's checkpoint "
                f"{self._checkpoint!r}; " + "; ".join(mismatched),
                code="upstream_error",
            )
        answered = [r for r, o in zip(self._replicas, outcomes, strict=True) if o is None]
        if not answered:
            reasons = "; ".join(
                f"{r.name}: {_reason(o)}" for r, o in zip(self._replicas, outcomes, strict=True)
            )
            raise EngineError(
                f"no upstream replica answered GET /v1/models ({reasons})", code="upstream_error"
            )
        for r, o in zip(self._replicas, outcomes, strict=True):
            if o is None:
                self._set_health(r, True)
            else:  # starts down; the health loop brings it in once it answers
                log.warning("upstream.down", upstream=r.name, reason=_reason(o))
        first = answered[0]
        self.model_id = self._model_id_arg or first.model or self.model_id
        self._fit_context()
        self._started = True
        self._tasks = [
            asyncio.create_task(self._health_loop(), name="upstream health"),
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

    def _fit_context(self) -> None:
        """The context every replica that answered can take (the smallest reported, under the
        configured one); again whenever a replica first answers, which may report less."""
        reported = [r.context_tokens for r in self._replicas if r.verified and r.context_tokens]
        if self._context_arg and reported and self._context_arg > min(reported):
            log.warning(
                "upstream.context_capped",
                configured=self._context_arg,
                replicas_report=min(reported),
            )
        limits = [v for v in (self._context_arg, min(reported, default=0)) if v]
        self.context_tokens = min(limits) if limits else DEFAULT_CONTEXT_TOKENS

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
        return math.ceil(len(text.encode()) / 3)

    def forget(self, kv_key: str) -> None:
        """Nothing to drop: the replicas' prefix caches age out on their own."""

    def stats(self) -> EngineStats:
        return EngineStats(running=self._router.in_flight())

    # -- replicas ---------------------------------------------------------------------------

    def _headers(self, replica: Replica) -> dict[str, str]:
        key = replica.upstream.api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    async def _describe(self, replica: Replica) -> None:
        """GET /v1/models: the model name to send, its context, what checkpoint it serves."""
        assert self._client is not None
        response = await self._client.get(
            f"{replica.upstream.base_url}/v1/models",
            headers=self._headers(replica),
            timeout=self._health_timeout,
        )
        if response.status_code != 200:
            raise StreamBroken(f"GET /v1/models answered HTTP {response.status_code}")
        entries = response.json().get("data") or []
        entry = next((e for e in entries if e.get("id") == replica.model), None)
        if entry is None and replica.model is None:
            entry = entries[0] if entries else None
        if replica.model is None:
            if entry is None:
                raise StreamBroken("GET /v1/models listed no model")
            replica.model = str(entry["id"])
        entry = entry or {"id": replica.model}  # a configured name the list does not show
        replica.context_tokens = int(entry.get("max_model_len") or 0)
        replica.served = tuple(str(entry[k]) for k in ("id", "root") if entry.get(k))
        extension = entry.get("visiongate") if isinstance(entry.get("visiongate"), dict) else {}
        fingerprint = entry.get("encoder_fingerprint") or extension.get("encoder_fingerprint")
        replica.encoder_fingerprint = str(fingerprint) if fingerprint else None
        if self.image_input == "embeds":
            self._check_checkpoint(replica)
        replica.verified = True

    def _check_checkpoint(self, replica: Replica) -> None:
        want = (self._checkpoint or "").lower()
        names = [s.rstrip("/").rsplit("/", 1)[-1].lower() for s in replica.served or ()]
        if want not in names:
            raise _Mismatch(
                f"it serves {', '.join(replica.served) or replica.model or 'an unnamed model'}"
            )

    def _set_health(self, replica: Replica, ok: bool, reason: str | None = None) -> None:
        if replica.healthy == ok:
            return
        replica.healthy = ok
        if ok:
            log.info("upstream.up", upstream=replica.name)
        else:
            log.warning("upstream.down", upstream=replica.name, reason=reason)

    async def _probe(self, replica: Replica) -> None:
        assert self._client is not None
        try:
            if not replica.verified:  # never answered /v1/models: learn what it serves first
                await self._describe(replica)
                self._fit_context()
                self._set_health(replica, True)
                return
            response = await self._client.get(
                f"{replica.upstream.base_url}/health",
                headers=self._headers(replica),
                timeout=self._health_timeout,
            )
            if response.status_code in (404, 405):  # no /health: /v1/models says it is up
                response = await self._client.get(
                    f"{replica.upstream.base_url}/v1/models",
                    headers=self._headers(replica),
                    timeout=self._health_timeout,
                )
            ok = response.status_code == 200
            self._set_health(replica, ok, None if ok else f"HTTP {response.status_code}")
        except _Mismatch as exc:
            log.error("upstream.wrong_checkpoint", upstream=replica.name, reason=str(exc))
            self._set_health(replica, False, "serves another checkpoint")
        except Exception as exc:
            self._set_health(replica, False, _reason(exc))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            await asyncio.gather(*(self._probe(r) for r in self._replicas))

    async def _watch_cancels(self) -> None:
        """Wakes a request waiting for a chunk when its cancel event is set."""
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            for run in self._runs:
                if run.cancel.is_set() and run.queue is not None:
                    run.queue.put_nowait(CANCELLED)

    # -- generation -------------------------------------------------------------------------

    def _body(self, request: GenerationRequest) -> tuple[str, dict[str, Any]]:
        """The path and body of `request`, without "model" (one per replica)."""
        s = request.sampling
        body: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
        if request.raw_prompt is not None:
            path = "/v1/completions"
            body["prompt"] = request.raw_prompt
        else:
            path = "/v1/chat/completions"
            body["messages"] = [
                {"role": m.role, "content": self._content(m.content)} for m in request.messages
            ]
        if self._cache_salt and request.cache_salt is not None:
            # vLLM's prefix-cache namespace: blocks are shared only between requests of one
            # API key (a hash of the key's owner id, which itself names no key)
            body["cache_salt"] = _salt_of(request.cache_salt)
        body["max_tokens"] = s.max_output_tokens
        if request.raw_prompt is None:
            body["max_completion_tokens"] = s.max_output_tokens
        body["temperature"] = s.temperature
        body["top_p"] = s.top_p
        body["n"] = max(1, s.n)
        if s.seed is not None:
            body["seed"] = s.seed
        if s.stop:
            body["stop"] = list(s.stop)
        if s.logprobs is not None:
            if request.raw_prompt is not None:
                body["logprobs"] = s.logprobs
            else:
                body["logprobs"] = True
                body["top_logprobs"] = s.logprobs
        return path, body

    def _content(self, parts: Sequence[str | ImageInput]) -> str | list[dict[str, Any]]:
        if all(isinstance(p, str) for p in parts):
            return "\n".join(parts)  # type: ignore[arg-type]
        return [
            {"type": "text", "text": p}
            if isinstance(p, str)
            else self._images.get(p, self.image_input)
            for p in parts
        ]

    def _candidates(self, request: GenerationRequest) -> list[Replica]:
        order = self._router.order(route_key(request))
        if self.image_input != "embeds":
            return order
        prefixes = {
            p.digest.split(":", 1)[0]
            for m in request.messages
            for p in m.content
            if isinstance(p, ImageInput) and ":" in p.digest
        }
        if not prefixes:
            return order
        fit = [
            r
            for r in order
            if r.encoder_fingerprint is None
            or all(r.encoder_fingerprint.startswith(p) for p in prefixes)
        ]
        if not fit:
            raise EngineError(
                "every upstream replica reports another encoder fingerprint than this gateway's",
                code="upstream_error",
            )
        return fit

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        if request.sampling.grammar is not None:
            raise EngineError(
                "constrained output (a grammar, JSON schema or forced tool call) cannot be "
                "forwarded to an upstream engine",
                code="invalid_request",
            )
        if not self._started or self._client is None:
            raise EngineError("the upstream engine is not started", code="upstream_error")
        run = Run(request)
        if self._images.missing_bytes(request) > RENDER_OFF_LOOP_BYTES:
            path, body = await asyncio.to_thread(self._body, request)  # base64 of megabytes
        else:
            path, body = self._body(request)
        order = self._candidates(request)
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
        headers = self._headers(replica)
        headers["content-type"] = "application/json"
        _propagator.inject(headers, context=trace.set_span_in_context(span))
        payload = json_encoder.encode({"model": replica.model or self.model_id, **body})
        queue: asyncio.Queue[Any] = asyncio.Queue()
        run.queue = queue
        run.sent_at = None
        replica.in_flight += 1
        reader = asyncio.create_task(
            self._read(f"{replica.upstream.base_url}{path}", payload, headers, queue, run, span)
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
            self._on_status(replica, exc)
        except Exception as exc:  # transport errors, a broken stream, bad JSON
            if run.emitted:
                raise _mid_answer(replica, exc) from None
            self._set_health(replica, False, _reason(exc))
            outcome = "error" if last else "failover"
            raise Retry(_reason(exc)) from None
        finally:
            if outcome == "error" and run.cancel.is_set():
                outcome = "cancelled"
            if outcome == "ok" and not reader.done() and not run.overrun:
                # it reads the body's last bytes, so the connection goes back to the pool;
                # a body that does not end soon is cut (its connection closed)
                drain = asyncio.create_task(_drain(reader))
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

    def _on_status(self, replica: Replica, exc: UpstreamStatus) -> None:
        """Raise what a non-200 answer means (see the module docstring)."""
        status = exc.status
        if status == 429:
            raise Retry("HTTP 429", busy_after=exc.retry_after or 1.0)
        if status >= 500 or status == 408:
            if status >= 500:
                self._set_health(replica, False, f"HTTP {status}")
            raise Retry(f"HTTP {status}: {clip(exc.text)}")
        if status in (400, 422):
            if exc.code == "context_length_exceeded" or _CONTEXT_MESSAGE.search(exc.text):
                raise EngineError(clip(exc.text, 400), code="context_length_exceeded")
            raise EngineError(clip(exc.text, 400) or "refused", code="invalid_request")
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

    async def _read(
        self,
        url: str,
        payload: bytes,
        headers: dict[str, str],
        queue: asyncio.Queue[Any],
        run: Run,
        span: Span,
    ) -> None:
        """Send the request and put its parsed chunks on `queue`, then `DONE` (or `EOF`, or
        the error)."""
        assert self._client is not None

        async def sent(name: str, _info: Mapping[str, Any]) -> None:
            if name.endswith("send_request_headers.started"):
                run.sent_at = time.perf_counter()

        try:
            request = self._client.build_request(
                "POST", url, content=payload, headers=headers, extensions={"trace": sent}
            )
            response = await self._client.send(request, stream=True)
            try:
                span.set_attribute("http.response.status_code", response.status_code)
                if response.status_code != 200:
                    body = await response.aread()
                    raise UpstreamStatus(response.status_code, body, retry_after(response.headers))
                decode = chunk_decoder.decode
                done = False
                # server-sent events split into lines by hand, on bytes (msgspec decodes each
                # `data:` line's bytes directly). `partial` holds an unfinished line; only new
                # bytes are searched for its end, so a long line costs linear time.
                partial = bytearray()
                async for piece in response.aiter_bytes():
                    if done:
                        continue  # after [DONE]: read to the end of the body all the same
                    cut = max(piece.rfind(b"\n"), piece.rfind(b"\r"))  # \n, \r\n or \r
                    if cut < 0:
                        partial += piece
                        if len(partial) > MAX_SSE_LINE_BYTES:
                            raise StreamBroken("an upstream event line is too long")
                        continue
                    head, rest = piece[: cut + 1], piece[cut + 1 :]
                    if partial:
                        partial += head
                        head = bytes(partial)
                        partial.clear()
                    partial += rest
                    for line in head.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue  # blank separators, comments, event names
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            done = True
                            queue.put_nowait(DONE)
                            break
                        queue.put_nowait(decode(data))
                last = bytes(partial).strip()
                if not done and last.startswith(b"data:"):  # a last line without its newline
                    data = last[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        queue.put_nowait(DONE)
                    elif data:
                        queue.put_nowait(decode(data))
                if not done:
                    queue.put_nowait(EOF)
            finally:
                await response.aclose()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            queue.put_nowait(exc)


def _mid_answer(replica: Replica, exc: BaseException) -> EngineError:
    """What a failure after the first text becomes (the replica's words stay in the log)."""
    log.warning("upstream.failed_mid_answer", upstream=replica.name, reason=_reason(exc))
    return EngineError("the upstream replica failed mid-answer", code="upstream_error")


def _salt_of(owner: str) -> str:
    return hashlib.sha256(f"visiongate-cache-salt\0{owner}".encode()).hexdigest()


async def _drain(reader: asyncio.Task[None]) -> None:
    """Let `reader` finish a body whose answer is complete, for at most DRAIN_S."""
    with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
        await asyncio.wait_for(reader, DRAIN_S)


def _reason(exc: object) -> str:
    """A short reason for logs and errors (never a key: exceptions name host:port at most)."""
    if isinstance(exc, httpx.ConnectError):
        return "connection refused or unreachable"
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    if isinstance(exc, httpx.TransportError):
        return f"connection failed ({type(exc).__name__})"
    if isinstance(exc, BaseException):
        return clip(str(exc) or type(exc).__name__)
    return clip(str(exc))


def _text_hidden_size(model_path: str) -> int:
    """The language model's hidden size from a checkpoint's config.json (its text config's,
    for a VLM); 0 when it does not say (a tokenizer-only directory has no config.json)."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        config = json.load(f)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    size = text.get("hidden_size") or config.get("hidden_size")
    if size:
        return int(size)
    from transformers import AutoConfig  # defaults a sparse config.json leaves out

    auto = AutoConfig.from_pretrained(model_path, local_files_only=True)
    return int(getattr(auto.get_text_config(), "hidden_size", 0) or 0)


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
