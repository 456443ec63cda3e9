"""The wire of the `openai` engine: what goes to an OpenAI-compatible replica and what comes back.

Request side: an image part per image mode (`render_image`, kept per image by `ImageParts` so a
conversation's old images are not base64-encoded again every turn). Response side: the
streamed chunks as msgspec structs (`Chunk`), errors as they arrive (`UpstreamStatus`,
`StreamBroken`, `Retry`), and `Run`, what one request has streamed over its attempts and the
`GenerationResult`s it ends with. `gateway.engine.upstream.openai_engine` documents the bodies.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import math
import re
import threading
import time
from collections import OrderedDict
from typing import Any

import httpx
import msgspec

from gateway.engine.interface import (
    EngineError,
    GenerationRequest,
    GenerationResult,
    ImageInput,
    ImageInputKind,
    TextDelta,
    TokenLogprob,
)
from gateway.protocol.errors import clip

SHA256_HEX = re.compile(r"[0-9a-f]{64}")
IMAGE_PART_CACHE_BYTES = 64 << 20  # rendered image parts kept for the next turn
MAX_RETRY_AFTER_S = 60.0  # an upstream's Retry-After passed on to clients, at most
# ------------------------------------------------------------------------- the wire (SSE)


class Top(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class WireTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[Top] | None = None


class Logprobs(msgspec.Struct):
    content: list[WireTokenLogprob] | None = None  # chat completions
    tokens: list[str] | None = None  # completions: parallel lists
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


class WireDelta(msgspec.Struct):
    content: str | None = None


class WireChoice(msgspec.Struct):
    index: int = 0
    delta: WireDelta | None = None  # chat completions
    text: str | None = None  # completions
    finish_reason: str | None = None
    logprobs: Logprobs | None = None


class PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None
    image_tokens: int | None = None
    # vLLM's count of placeholder tokens by modality ({"image": N}): its `image_tokens` is null
    multimodal_tokens: Any = None  # read leniently: a field of one server, not of the API

    @property
    def images(self) -> int:
        if self.image_tokens:
            return self.image_tokens
        by_modality = self.multimodal_tokens
        count = by_modality.get("image") if isinstance(by_modality, dict) else None
        return count if isinstance(count, int) and count > 0 else 0


class WireUsage(msgspec.Struct):
    prompt_tokens: int | None = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptDetails | None = None


class Chunk(msgspec.Struct):
    choices: list[WireChoice] | None = None
    usage: WireUsage | None = None
    error: Any = None  # an error reported inside the stream
    object: str | None = None  # "error" on vLLM's and SGLang's error objects
    message: str | None = None
    code: Any = None  # a top-level error object's HTTP status


chunk_decoder = msgspec.json.Decoder(Chunk)
json_encoder = msgspec.json.Encoder()


class UpstreamStatus(Exception):
    """A non-200 answer: its status, error text and Retry-After."""

    def __init__(self, status: int, body: bytes, retry_after: float | None) -> None:
        self.status, self.retry_after = status, retry_after
        self.code, self.text = error_of(body)
        super().__init__(f"HTTP {status}: {clip(self.text)}")


class StreamBroken(Exception):
    """The stream broke: an error chunk, bad JSON, or an end before every choice finished."""


class Retry(Exception):
    """This attempt failed before any text: try the next replica."""

    def __init__(self, reason: str, *, busy_after: float | None = None) -> None:
        super().__init__(reason)
        self.busy_after = busy_after  # set for a 429: its Retry-After (or 1 s)


OVERRUN = "visiongate:overrun"  # a choice's finish when the upstream ignored max_tokens
# finish reasons that mean the answer was cut short upstream (vLLM's "abort"); any other is an
# end of the answer (stop, length, tool_calls, content_filter, eos_token, ...)
FAILED_FINISHES = frozenset({"abort", "error", "cancelled", "canceled"})
DONE = object()  # the stream said [DONE]
EOF = object()  # the body ended without [DONE]: whole only if every choice finished
CANCELLED = object()  # request.cancel was set


def error_of(body: bytes) -> tuple[str | None, str]:
    """(code, message) of an OpenAI-style error body, whatever its nesting."""
    try:
        data = json.loads(body)
    except ValueError:
        return None, body.decode("utf-8", "replace").strip()
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        data = data["error"]
    if not isinstance(data, dict):
        return None, str(data)
    code = data.get("code") if isinstance(data.get("code"), str) else None
    message = data.get("message") or data.get("detail") or data.get("error") or ""
    return code, message if isinstance(message, str) else json.dumps(message)


def in_stream_http_status(error: Any, chunk: Any) -> int | None:
    """The HTTP status an in-stream error object names (its `code` or `status`), or None."""
    for value in (
        error.get("code") if isinstance(error, dict) else None,
        error.get("status") if isinstance(error, dict) else None,
        getattr(chunk, "code", None),
    ):
        if isinstance(value, int) and 400 <= value <= 599:
            return value
    return None


def retry_after(headers: httpx.Headers) -> float | None:
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # an HTTP date: rare here, and a default is as good
    if not math.isfinite(seconds):
        return None  # "inf", "nan", "1e400": no usable hint
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def token_logprobs(logprobs: Logprobs | None) -> tuple[TokenLogprob, ...]:
    if logprobs is None:
        return ()
    if logprobs.content is not None:
        return tuple(
            TokenLogprob(
                t.token,
                t.logprob,
                bytes(t.bytes) if t.bytes is not None else t.token.encode(),
                tuple(
                    (
                        a.token,
                        a.logprob,
                        bytes(a.bytes) if a.bytes is not None else a.token.encode(),
                    )
                    for a in t.top_logprobs or ()
                ),
            )
            for t in logprobs.content
        )
    tokens = logprobs.tokens or []
    values = logprobs.token_logprobs or []
    tops = logprobs.top_logprobs or []
    out = []
    for i, token in enumerate(tokens):
        top = tops[i] if i < len(tops) and tops[i] else {}
        alternatives = sorted(top.items(), key=lambda kv: kv[1], reverse=True)
        out.append(
            TokenLogprob(
                token,
                float(values[i]) if i < len(values) and values[i] is not None else 0.0,
                token.encode(),
                tuple((t, lp, t.encode()) for t, lp in alternatives),
            )
        )
    return tuple(out)


# ------------------------------------------------------------------------ request bodies


def tensor_b64(tensor: Any) -> str:
    """vLLM's wire form of a tensor: `torch.save` of a compact copy, base64. (The replica
    loads it with `torch.load(weights_only=True)`; this side only writes.)"""
    import torch

    buf = io.BytesIO()
    torch.save(tensor.detach().cpu().contiguous().clone(), buf)  # a view would save its base
    return base64.b64encode(buf.getvalue()).decode("ascii")


def grid_thw(mrope: tuple[int, ...], rows: int, merge: int = 2) -> list[int] | None:
    """The [t, h, w] patch grid of an M-RoPE image from its rows' (t, h, w) positions, which
    are of merged tokens (`merge` x `merge` patches each, the checkpoint's spatial merge size),
    or None when rows were dropped (the grid would not match the rows).

    One image's grid is a 1-D tensor of 3: vLLM stacks the items' grids into [images, 3] (its
    `image_grid_thw` field is batched per item), so a [1, 3] grid per item reaches its model
    as [1, 1, 3] and is refused ("size_per_item should be a 1-D tensor")."""
    t, h, w = (max(mrope[i::3]) + 1 for i in range(3))
    if t * h * w != rows:
        return None
    return [t, h * merge, w * merge]


class ImageParts:
    """Rendered image parts by content id (base64 is the costly part, and a conversation
    sends its images again every turn), up to a byte budget, least recently used first out.
    Thread-safe: large images are rendered off the event loop."""

    __slots__ = ("_budget", "_bytes", "_lock", "_parts")

    def __init__(self, budget: int = IMAGE_PART_CACHE_BYTES) -> None:
        self._parts: OrderedDict[str, tuple[dict[str, Any], int]] = OrderedDict()
        self._budget, self._bytes = budget, 0
        self._lock = threading.Lock()

    def missing_bytes(self, request: GenerationRequest) -> int:
        """Bytes of the request's images that are not rendered yet."""
        with self._lock:
            return sum(
                len(p.data or b"") + p.embeds_nbytes
                for m in request.messages
                for p in m.content
                if isinstance(p, ImageInput) and p.digest not in self._parts
            )

    def get(self, image: ImageInput, kind: ImageInputKind) -> dict[str, Any]:
        with self._lock:
            found = self._parts.get(image.digest)
            if found is not None:
                self._parts.move_to_end(image.digest)
                return found[0]
        part, size = render_image(image, kind)
        if size <= self._budget:
            with self._lock:
                if image.digest not in self._parts:
                    self._parts[image.digest] = (part, size)
                    self._bytes += size
                while self._bytes > self._budget:
                    _, (_, dropped) = self._parts.popitem(last=False)
                    self._bytes -= dropped
        return part


def render_image(image: ImageInput, kind: ImageInputKind) -> tuple[dict[str, Any], int]:
    if kind == "bytes":
        if image.data is None:
            raise EngineError("an image reached the upstream engine without its bytes")
        b64 = base64.b64encode(image.data).decode("ascii")
        url: dict[str, Any] = {"url": f"data:{image.mime or 'image/jpeg'};base64,{b64}"}
        if SHA256_HEX.fullmatch(image.digest) and (
            hashlib.sha256(image.data).hexdigest() == image.digest
        ):
            url["content_hash"] = f"sha256:{image.digest}"
        return {"type": "image_url", "image_url": url, "uuid": image.digest}, len(b64)
    tokens = image.embeds  # decoded here, on a miss of the rendered parts, only
    if tokens is None:
        raise EngineError("an image reached the upstream engine without its visual tokens")
    embeds: Any = tensor_b64(tokens)
    size = len(embeds)
    layout = image.layout
    if layout is not None and layout.mrope:
        grid = grid_thw(layout.mrope, int(tokens.shape[0]), layout.mrope_merge)
        if grid is None:
            raise EngineError(
                "an upstream M-RoPE model takes an image's whole grid of visual tokens; run the "
                "encoder without patch dropping (--pruning none)",
                code="upstream_error",
            )
        import torch

        embeds = {"image_embeds": embeds, "image_grid_thw": tensor_b64(torch.tensor(grid))}
    return {"type": "image_embeds", "image_embeds": embeds, "uuid": image.digest}, size


# ------------------------------------------------------------------------ one request


class Run:
    """What one request streamed so far, over its attempts (only the last one streams)."""

    __slots__ = (
        "cancel",
        "chunks",
        "constrained",
        "ended",
        "finish",
        "first_at",
        "gaps",
        "last_at",
        "max_tokens",
        "n",
        "queue",
        "sent_at",
        "started_at",
        "texts",
        "usage",
    )

    def __init__(self, request: GenerationRequest) -> None:
        n = max(1, request.sampling.n)
        self.n = n
        self.max_tokens = request.sampling.max_output_tokens
        self.constrained = request.sampling.grammar is not None
        self.cancel = request.cancel
        self.started_at = time.perf_counter()
        self.sent_at: float | None = None
        self.first_at: float | None = None
        self.last_at: list[float | None] = [None] * n
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.chunks = [0] * n
        self.gaps: list[list[float]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.usage: WireUsage | None = None
        self.ended = False
        self.queue: asyncio.Queue[Any] | None = None

    @property
    def emitted(self) -> bool:
        return self.first_at is not None

    @property
    def overrun(self) -> bool:
        """Every choice has ended, one of them because the upstream went past max_tokens."""
        return OVERRUN in self.finish and all(self.finish)

    def aborted(self) -> str | None:
        """A finish reason that means the answer was cut short upstream (vLLM's "abort")."""
        return next((r for r in self.finish if r in FAILED_FINISHES), None)

    def absorb(self, chunk: Chunk) -> list[TextDelta]:
        if chunk.error is not None or chunk.object == "error":
            error = chunk.error if chunk.error is not None else chunk.message
            status = in_stream_http_status(error, chunk)
            if status is not None:  # an HTTP-style error sent in the stream (vLLM does)
                body = {"error": error} if isinstance(error, dict) else {"message": error}
                raise UpstreamStatus(status, json.dumps(body).encode(), None)
            if isinstance(error, dict):
                error = error.get("message", error)
            raise StreamBroken(f"the upstream reported an error mid-stream: {clip(error)}")
        if chunk.usage is not None:
            self.usage = chunk.usage
        out: list[TextDelta] = []
        now = time.perf_counter()
        for choice in chunk.choices or ():
            i = choice.index
            if not 0 <= i < self.n or self.finish[i] == OVERRUN:
                continue
            text = choice.delta.content if choice.delta is not None else choice.text
            logprobs = token_logprobs(choice.logprobs)
            if text and choice.finish_reason is None and self.chunks[i] >= self.max_tokens:
                # more text chunks than tokens allowed (each holds one at least): the upstream
                # ignores max_tokens, so the answer is cut here
                self.finish[i] = OVERRUN
                continue
            if text or logprobs:
                text = text or ""
                if self.first_at is None:
                    self.first_at = now
                last = self.last_at[i]
                if last is not None:
                    self.gaps[i].append(round((now - last) * 1e3, 3))
                self.last_at[i] = now
                self.texts[i].append(text)
                self.chunks[i] += 1
                out.append(TextDelta(text, index=i, logprobs=logprobs))
            if choice.finish_reason is not None:
                self.finish[i] = choice.finish_reason
        return out

    def results(self, cancelled: bool = False) -> list[GenerationResult]:
        now = time.perf_counter()
        sent = self.sent_at if self.sent_at is not None else now
        usage = self.usage
        details = usage.prompt_tokens_details if usage is not None else None
        streamed = sum(self.chunks)
        total_out = (usage.completion_tokens or 0) if usage is not None else 0
        first = self.first_at
        out = []
        for i in range(self.n):
            if usage is None or not total_out:
                output_tokens = self.chunks[i]
            elif self.n == 1:
                output_tokens = total_out
            else:  # split by the chunks each choice streamed
                output_tokens = round(total_out * self.chunks[i] / streamed) if streamed else 0
            reason = self.finish[i]
            out.append(
                GenerationResult(
                    text="".join(self.texts[i]),
                    finish_reason="cancelled"
                    if cancelled
                    else ("length" if reason in ("length", OVERRUN) else "stop"),
                    input_tokens=(usage.prompt_tokens or 0) if usage is not None else 0,
                    image_tokens=details.images if details is not None else 0,
                    output_tokens=output_tokens,
                    cached_tokens=(details.cached_tokens or 0) if details is not None else 0,
                    queue_ms=round((sent - self.started_at) * 1e3, 3),
                    prefill_ms=round((first - sent) * 1e3, 3) if first is not None else 0.0,
                    decode_ms=round((now - first) * 1e3, 3) if first is not None else 0.0,
                    ttft_ms=round((first - sent) * 1e3, 3) if first is not None else 0.0,
                    itl_ms=tuple(self.gaps[i]),
                    index=i,
                )
            )
        return out
