"""A deterministic, instant engine and encoder for the fast tests.

These stand in for the real language model and vision tower only where a test is about the
gateway's own logic (request checks, sessions, the Realtime state machine, HTTP shaping): they
speak the same `Engine` / `Encoder` protocols, so `create_app(settings, engine=FakeEngine(),
encoder=FakeEncoder())` runs every other part for real (Litestar, uvicorn, the stores, the
vision cache, the wire codecs). The slow suite keeps the real SmolLM2 engine and encoder.

`FakeEngine` answers with the words of the last user message, one word per text delta, then
`[n images]`; it runs the real engine's request check (`check_request`: sampling ranges, stop
strings, image embeds) and honours max_output_tokens, stop strings (held back, never leaked),
cancel and a context limit the way the real scheduler does (same codes). `FakeEncoder` decodes
the image header for real (so bad images fail with the real codes) and returns `tokens` rows
derived from the bytes' digest.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import torch

from encoder_worker.decode import check_image
from encoder_worker.payload import float_tokens
from encoder_worker.types import EncodedImage
from gateway.engine.interface import (
    Delta,
    EngineBusy,
    EngineCapabilities,
    EngineError,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    ImageInput,
    TextDelta,
    TokenLogprob,
    WarmUpResult,
)
from gateway.engine.local.sequence import check_request

__all__ = ("FakeEncoder", "FakeEngine")


class FakeEngine:
    """Echoes the last user message word by word. `delay_s` spaces the deltas (for cancel and
    disconnect tests); `busy=True` refuses like a full queue; `context_tokens` is the limit;
    `start_delay_s` keeps it loading that long, `loaded` (a threading.Event) until the test
    sets it; `refuse` is an EngineError raised on the first step of every request (a refusal of
    the engine's own, whatever the gateway checked before); `fail_after=n` raises an
    `engine_error` after n text deltas (a fault mid-stream). It takes visual tokens and keeps
    no KV to warm up: a subclass that takes bytes, or warms up, declares it in `capabilities`."""

    model_id = "fake-echo"
    capabilities = EngineCapabilities()

    def __init__(
        self,
        *,
        hidden_size: int = 32,
        delay_s: float = 0.0,
        busy: bool = False,
        context_tokens: int = 8192,
        start_delay_s: float = 0.0,
        refuse: EngineError | None = None,
        fail_after: int | None = None,
        loaded: threading.Event | None = None,
    ) -> None:
        self.hidden_size = hidden_size
        self.delay_s = delay_s
        self.busy = busy
        self.context_tokens = context_tokens
        self.start_delay_s = start_delay_s
        self.refuse = refuse
        self.fail_after = fail_after
        self.loaded = loaded
        self.requests: list[GenerationRequest] = []  # every request seen, in order
        self.forgotten: list[str] = []
        self.running = 0
        self._ready = False

    @property
    def ready(self) -> bool:
        return self._ready

    async def start(self) -> None:
        if self.start_delay_s:
            await asyncio.sleep(self.start_delay_s)
        # set from the test's thread, not this loop's: polled, so shutting down still cancels it
        while self.loaded is not None and not self.loaded.is_set():
            await asyncio.sleep(0.01)
        self._ready = True

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def _prompt_tokens(self, request: GenerationRequest) -> tuple[int, int]:
        raw = request.raw_prompt  # a legacy completion's prompt: its ids, or its text's count
        if raw is not None:
            return (len(raw) if isinstance(raw, tuple) else self.count_tokens(raw)), 0
        text = images = 0
        for message in request.messages:
            for part in message.content:
                if isinstance(part, ImageInput):
                    images += part.num_tokens
                else:
                    text += self.count_tokens(part) + 1
        return text + images, images

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        if self.busy:
            raise EngineBusy("the engine queue is full", retry_after_s=1.0)
        self.requests.append(request)
        if self.refuse is not None:
            raise self.refuse
        # the real engine's refusals (empty prompt, embeds of the wrong width or not finite,
        # sampling out of range, too many stops), with their codes
        check_request(request, self.hidden_size, self.capabilities.image_input)
        input_tokens, image_tokens = self._prompt_tokens(request)
        if input_tokens > self.context_tokens:
            raise EngineError(
                f"the prompt has {input_tokens} tokens; the context holds {self.context_tokens}",
                code="context_length_exceeded",
            )
        if request.raw_prompt is not None:
            raw = request.raw_prompt
            words = raw.split() if isinstance(raw, str) else [f"#{i}" for i in raw]
            n_images = 0
        else:
            last = next((m for m in reversed(request.messages) if m.role == "user"), None)
            words = [p for p in (last.content if last else []) if isinstance(p, str)]
            n_images = sum(isinstance(p, ImageInput) for p in (last.content if last else []))
        tokens = [*" ".join(words).split(), f"[{n_images} images]"]
        # choices after the first echo the same words, tagged with their index
        for index in range(request.sampling.n):
            choice = tokens if index == 0 else [*tokens, f"#{index}"]
            # closed with this stream, as an engine's own stream ends when it is closed
            answer = self._choice(request, choice, index, input_tokens, image_tokens)
            async with contextlib.aclosing(answer):
                async for delta in answer:
                    yield delta

    async def _choice(
        self,
        request: GenerationRequest,
        tokens: list[str],
        index: int,
        input_tokens: int,
        image_tokens: int,
    ) -> AsyncIterator[Delta]:
        sampling = request.sampling
        # `text` is the answer so far, `sent` how much of it went out: like the real detokenizer,
        # a tail that could begin a stop string is held back, so no stop string ever leaks and
        # the deltas always add up to the result's text
        text, sent, emitted, finish = "", 0, 0, "stop"
        pending: list[TokenLogprob] = []  # logprobs of words not sent yet

        def delta(piece: str) -> TextDelta:
            if not pending:
                return TextDelta(piece, index)
            sent_logprobs = tuple(pending)
            pending.clear()
            return TextDelta(piece, index=index, logprobs=sent_logprobs)

        stops = sampling.stop  # without any, nothing is held back or searched for

        self.running += 1
        try:
            for word in tokens:
                if request.cancel.is_set():
                    finish = "cancelled"
                    break
                if emitted >= sampling.max_output_tokens:
                    finish = "length"
                    break
                piece = f" {word}" if text else word
                text += piece
                emitted += 1
                if sampling.logprobs is not None:
                    pending.append(_fake_logprob(piece, sampling.logprobs))
                if not stops:
                    yield delta(piece)
                    sent = len(text)
                else:
                    stop_at = min((text.find(s) for s in stops if s in text), default=-1)
                    if stop_at >= 0:
                        text = text[:stop_at]
                        if len(text) > sent:
                            yield delta(text[sent:])
                        sent = len(text)
                        break
                    end = len(text) - _held_back(text, stops)
                    if end > sent:
                        yield delta(text[sent:end])
                        sent = end
                if self.fail_after is not None and emitted >= self.fail_after:
                    raise EngineError("the fake engine failed as asked", code="engine_error")
                await asyncio.sleep(self.delay_s)
            if finish == "cancelled":
                text = text[:sent]  # what went out is the answer
            elif len(text) > sent:
                yield delta(text[sent:])
        finally:
            self.running -= 1
        yield GenerationResult(
            text=text,
            finish_reason=finish,
            input_tokens=input_tokens,
            image_tokens=image_tokens,
            output_tokens=emitted,
            index=index,
            logprobs=tuple(pending),
        )

    def forget(self, kv_key: str) -> None:
        self.forgotten.append(kv_key)

    def stats(self) -> EngineStats:
        return EngineStats(running=self.running)

    async def warm_up(self, request: GenerationRequest) -> WarmUpResult:
        return WarmUpResult("failed", reason="the fake engine keeps no KV")

    def bind_telemetry(self, telemetry: Any) -> None:
        """Nothing of its own to trace or count."""

    async def aclose(self) -> None:
        self._ready = False


def _fake_logprob(piece: str, top: int) -> TokenLogprob:
    """A made-up but well-formed log-probability: the word is the most likely of `top`."""
    raw = piece.encode()
    alternatives = [(piece, -0.25, raw)] + [
        (f"{piece}~{k}", -1.0 - k, f"{piece}~{k}".encode()) for k in range(1, top)
    ]
    return TokenLogprob(piece, -0.25, raw, tuple(alternatives[:top]))


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is the start of a stop string."""
    return max(
        (
            n
            for s in stops
            for n in range(min(len(s) - 1, len(text)), 0, -1)
            if s.startswith(text[-n:])
        ),
        default=0,
    )


class FakeEncoder:
    """Checks the image header for real, then returns `tokens` deterministic rows per image.
    `delay_s` spaces encodes (and is reported as the image's `vision` stage time, as a real
    encode reports its stages); with `gate` (a threading.Event) each encode waits until it is
    set. `owners` records the `owner` of each encode, in the order they finished."""

    remote = False

    def __init__(
        self,
        *,
        hidden_size: int = 32,
        tokens: int = 4,
        delay_s: float = 0.0,
        max_image_bytes: int = 20 * 1024 * 1024,
        max_pixels: int = 40_000_000,
        gate: threading.Event | None = None,
    ) -> None:
        self.hidden_size = hidden_size
        self.tokens = tokens
        self.delay_s = delay_s
        self.max_image_bytes = max_image_bytes
        self.max_pixels = max_pixels
        self.gate = gate
        identity = f"fake-encoder:{hidden_size}:{tokens}".encode()
        self.fingerprint = hashlib.sha256(identity).hexdigest()
        self.encoded: list[str] = []  # digests, in encode order
        self.owners: list[str | None] = []  # the owner of each of them
        self._waiting = 0

    async def start(self) -> None:
        return None

    async def encode(
        self, data: bytes, *, traceparent: str | None = None, owner: str | None = None
    ) -> EncodedImage:
        digest = hashlib.sha256(data).hexdigest()
        self._waiting += 1
        try:
            t0 = time.perf_counter()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            vision_ms = (time.perf_counter() - t0) * 1e3
            while self.gate is not None and not self.gate.is_set():
                await asyncio.sleep(0.01)  # set from any thread (see FakeEngine.start)
            check_image(data, self.max_image_bytes, self.max_pixels)  # ImageError: real codes
            seed = int(digest[:8], 16)
            rows = torch.Generator().manual_seed(seed)
            embeds = torch.randn(self.tokens, self.hidden_size, generator=rows) * 0.1
            payload = float_tokens(embeds, torch.arange(self.tokens), self.tokens, "fp32")
        finally:
            self._waiting -= 1
        self.encoded.append(digest)
        self.owners.append(owner)
        return EncodedImage(
            digest=digest,
            fingerprint=self.fingerprint,
            tokens_kept=self.tokens,
            tokens_total=self.tokens,
            hidden_size=self.hidden_size,
            payload=payload,
            timings_ms={"decode": 0.0, "vision": round(vision_ms, 3)},
        )

    async def queue_depth(self) -> int:
        return self._waiting

    async def aclose(self) -> None:
        return None
