"""The engine boundary: what the gateway hands a language model and what comes back.

An engine turns one `GenerationRequest` (chat messages whose user parts may hold images as
visual-token embeddings) into a stream of `TextDelta`s that ends with one `GenerationResult`.
It does not know about WebSockets, sessions or caches of encoded images: the gateway resolves
images to embeddings before calling it. It may keep KV state keyed by content (see
`GenerationRequest.kv_key`), which changes speed, never the answer.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from encoder_worker.types import ImageLayout

__all__ = (
    "CHARS_PER_TOKEN",
    "MAX_CHOICES",
    "MAX_STOPS",
    "MAX_STOP_CHARS",
    "MAX_TOP_LOGPROBS",
    "Delta",
    "Engine",
    "EngineBusy",
    "EngineCapabilities",
    "EngineError",
    "EngineStats",
    "GenerationRequest",
    "GenerationResult",
    "ImageInput",
    "ImageInputKind",
    "Message",
    "SamplingParams",
    "TextDelta",
    "TokenLogprob",
    "WarmUp",
    "WarmUpResult",
)

MAX_TOP_LOGPROBS = 20  # alternatives reported per token at most (as OpenAI's API)
MAX_CHOICES = 8  # completions per request at most (`SamplingParams.n`)
# Stop strings per request at most, and characters per stop string: an engine rescans every
# stop's prefixes against the text each token, so their number and length bound the per-token
# cost (on the local engine, of the thread every stream shares). The gateway checks them before
# any engine runs; the local engine checks them again.
MAX_STOPS = 4
MAX_STOP_CHARS = 256
# The characters a token of text is taken to hold where no tokenizer counts (an upstream engine
# without the checkpoint's tokenizer, the gateway's estimates before a turn runs): few, so that
# the estimates err high (real tokenizers average about 4 on English prose).
CHARS_PER_TOKEN = 3

Role = Literal["system", "user", "assistant"]
ImageInputKind = Literal["embeds", "bytes"]
# "slow_reader": the caller stopped taking deltas (more than the engine's unread limit were
# waiting), so generation stopped for it
FinishReason = Literal["stop", "length", "cancelled", "slow_reader"]
# What a KV warm-up prefills: the prompt through its last message as a finished turn
# ("message": the next turn starts a new message, as a Realtime item does), or through the last
# part of its last message, left open ("part": the question follows in the same message, as an
# HTTP turn sends it)
WarmUp = Literal["message", "part"]


class ImageInput:
    """One image as the language model sees it: its visual tokens, or (for an engine whose
    capabilities' `image_input` is "bytes") the original image bytes it encodes itself.

    The tokens may come lazily (`decode`, with their count `rows`): a conversation sends its
    images again every turn, and an engine that already holds an image's rendered form (an
    upstream replica's request part) never needs its tokens decoded again. `embeds` decodes them
    on first use and keeps them; `has_embeds` and `num_tokens` never decode."""

    __slots__ = ("_decode", "_embeds", "_hidden", "_rows", "data", "digest", "layout", "mime")

    def __init__(
        self,
        digest: str,
        embeds: torch.Tensor | None = None,
        layout: ImageLayout | None = None,
        data: bytes | None = None,
        mime: str | None = None,
        *,
        decode: Callable[[], torch.Tensor] | None = None,
        rows: int | None = None,
        hidden: int | None = None,
    ) -> None:
        if decode is not None and (embeds is not None or rows is None or hidden is None):
            raise ValueError("lazy visual tokens take `decode`, `rows` and `hidden`, no `embeds`")
        # identifies the image: in KV block hashes, and as the content id an upstream engine
        # keys its multimodal cache by. The sha256 hex of the original bytes, prefixed with the
        # encoder's fingerprint when tokens are given (other tokens are other content), or with
        # the owner's scope when images are not shared across API keys.
        self.digest = digest
        # [N, hidden] visual tokens in the LM's embedding space (any float dtype); None (and no
        # `decode`) when the engine takes the bytes instead
        self._embeds = embeds
        self._decode = decode
        self._rows = int(embeds.shape[0]) if embeds is not None else rows or 0
        self._hidden = int(embeds.shape[-1]) if embeds is not None else hidden or 0
        # Where the rows go for a real VLM checkpoint (its processor's expansion of the image
        # placeholder, M-RoPE positions); None: the embedded default's `<image>...</image>`
        # layout.
        self.layout = layout
        self.data = data  # the original image bytes (engines with image_input "bytes")
        self.mime = mime  # their media type, e.g. "image/png"

    @property
    def embeds(self) -> torch.Tensor | None:
        """The visual tokens [N, hidden], decoded on first use; None when the bytes are sent."""
        if self._embeds is None and self._decode is not None:
            tokens = self._decode()
            if tokens.ndim != 2 or tokens.shape != (self._rows, self._hidden):
                raise ValueError(
                    f"decoded visual tokens are {tuple(tokens.shape)}, not the "
                    f"({self._rows}, {self._hidden}) their image was stored with"
                )
            self._embeds, self._decode = tokens, None
        return self._embeds

    @property
    def has_embeds(self) -> bool:
        """Whether the image comes as visual tokens (decoded or not yet)."""
        return self._embeds is not None or self._decode is not None

    @property
    def num_tokens(self) -> int:
        return self._rows if self.has_embeds else 0

    @property
    def embeds_nbytes(self) -> int:
        """Bytes of the decoded tokens (float32 ones, until decoded), without decoding them."""
        if self._embeds is not None:
            return self._embeds.nbytes
        return 0 if self._decode is None else self._rows * self._hidden * 4

    def __repr__(self) -> str:
        tokens = f", tokens={self._rows}" if self.has_embeds else ""
        data = f", data={len(self.data)} bytes" if self.data is not None else ""
        return f"ImageInput({self.digest!r}{tokens}{data})"


@dataclass(slots=True)
class Message:
    role: Role
    content: list[str | ImageInput]  # parts in order; str parts are plain text


@dataclass(slots=True)
class SamplingParams:
    max_output_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # None: no log-probabilities; k >= 0: each token's log-probability under the model
    # (log-softmax of the raw logits, before temperature, top-p or a grammar) and its k most
    # likely alternatives (k <= MAX_TOP_LOGPROBS)
    logprobs: int | None = None
    # completions sampled from one prompt (1..MAX_CHOICES); the prompt is prefilled once and its
    # KV shared. Choice i > 0 with a seed samples with seed + i.
    n: int = 1
    # a constrained-decoding grammar (llguidance's Lark syntax, JSON schemas embedded with
    # %json): only tokens it allows are sampled, and the answer ends when it is complete.
    # None: unconstrained.
    grammar: str | None = None


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    messages: list[Message]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Namespace for reusable KV state (the session id). Reuse is still verified by content hashes.
    kv_key: str | None = None
    # Set by the caller to stop generation; the engine checks it before every decode step.
    cancel: threading.Event = field(default_factory=threading.Event)
    # Namespace of automatic prefix caching (the API key's id, maybe narrowed by a client's
    # salt): KV blocks are shared only between requests with the same salt. None: anonymous.
    cache_salt: str | None = None
    # Whose share of the engine this is (the API key's owner id: fair share, per-key queue
    # cap, preemption order); None: the cache salt names the owner too.
    owner: str | None = None
    # A plain-text prompt (legacy completions): tokenized as is, without the chat template, or
    # its token ids as the client sent them; `messages` are then ignored and may be empty.
    raw_prompt: str | tuple[int, ...] | None = None
    # A KV warm-up (`LocalEngine.warm_up`): the prompt rendered without a generation prompt,
    # prefilled into the prefix cache at the lowest priority and pinned for `kv_key` until its
    # next turn; nothing is generated. None: an ordinary request.
    warm_up: WarmUp | None = None


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """One generated token with its log-probability and the most likely alternatives."""

    token: str  # the token's text on its own (may be part of a multi-byte character)
    logprob: float
    bytes: bytes  # the token's UTF-8 bytes
    top: tuple[tuple[str, float, bytes], ...] = ()  # (token, logprob, bytes), most likely first


@dataclass(slots=True, frozen=True)
class TextDelta:
    text: str
    index: int = 0  # which choice (SamplingParams.n) the text belongs to
    # the tokens emitted since the previous delta of this choice, when logprobs were asked for
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(slots=True)
class GenerationResult:
    text: str
    finish_reason: FinishReason
    input_tokens: int  # prompt tokens, image tokens included
    image_tokens: int  # visual tokens in the prompt
    output_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV was reused instead of prefilled
    cached_image_tokens: int = 0  # of those, visual tokens
    queue_ms: float = 0.0  # waiting for the engine
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    ttft_ms: float = 0.0  # from the engine picking the request up to the first text delta
    itl_ms: tuple[float, ...] = ()  # gaps between consecutive text deltas (inter-token latency)
    prefill_chunks: int = 0  # scheduler steps the prompt's prefill was split over
    preemptions: int = 0  # times this request was preempted (its KV freed, later recomputed)
    index: int = 0  # which choice this result ends (one result per choice)
    # tokens whose log-probabilities were not sent with a delta (held back, then dropped by a
    # stop string or the end); only when logprobs were asked for
    logprobs: tuple[TokenLogprob, ...] = ()
    # of cached_tokens, positions a KV warm-up of this session computed ahead of the request
    warmed_tokens: int = 0


@dataclass(slots=True, frozen=True)
class WarmUpResult:
    """How a KV warm-up ended. "warmed": its positions are in the prefix cache, pinned for the
    session; "superseded": the session's own request came first (it takes over what the warm-up
    computed); "dropped": given up for other work (KV pressure, a queue full of warm-ups, a
    newer warm-up of the session, cancelled); "failed": its prompt was refused."""

    outcome: Literal["warmed", "superseded", "dropped", "failed"]
    positions: int = 0  # prompt positions the prefix cache holds for the session afterwards
    computed: int = 0  # of those, computed by this warm-up (the rest were already cached)
    queue_ms: float = 0.0  # waiting behind other work
    prefill_ms: float = 0.0  # from admission to its last position
    reason: str = ""  # why it was dropped or failed


@dataclass(slots=True, frozen=True)
class EngineStats:
    """A snapshot of the engine's scheduler, for gauges."""

    running: int = 0  # requests in the batch (prefilling or decoding)
    waiting: int = 0  # requests queued for a slot
    batch_size: int = 0  # sequences in the last step
    step_tokens: int = 0  # tokens (prefill chunks + decodes) in the last step
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_cached: int = 0  # free but holding reusable (prefix-cached) KV
    preemptions_total: int = 0
    owners_waiting: int = 0  # API keys with requests queued (a count, never the keys)


@dataclass(slots=True, frozen=True)
class EngineCapabilities:
    """What an engine takes and does besides `generate`, declared by the engine
    (`Engine.capabilities`), so that the gateway reads it instead of probing the engine.

    Every engine takes sampling, stop strings, `n` choices, log-probabilities and grammars
    (an upstream engine forwards them, and refuses what its replicas cannot do): they are not
    capabilities. Values an engine learns from its model (`embedding_rms`, `vocab_size`) are
    known once `start` returned."""

    # what it takes for an image: "embeds" (visual tokens from the gateway's encoder; the
    # in-process engine) or "bytes" (the original image, which it encodes itself; an upstream
    # engine sending images as data URLs)
    image_input: ImageInputKind = "embeds"
    # whether `warm_up` prefills a session's KV ahead of its next turn; when False it does
    # nothing and the gateway never schedules one
    warm_up: bool = False
    # what an image sent as bytes counts as, in prompt tokens, before the engine encodes it
    # (fitting a prompt to the context, a key's token limits); 0: the engine gives no figure
    image_tokens_estimate: int = 0
    # RMS of the model's token-embedding rows, which the seeded synthetic projector scales
    # visual tokens to; None: the engine asks for no rescaling
    embedding_rms: float | None = None
    # token ids the model's tokenizer has, against which the gateway checks a prompt sent as
    # ids; None: not known here (an upstream engine's replicas check them)
    vocab_size: int | None = None


Delta = TextDelta | GenerationResult


class EngineError(Exception):
    """An engine failure with a stable error code for the wire."""

    code = "engine_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class EngineBusy(EngineError):
    code = "busy"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # a hint for HTTP Retry-After


@runtime_checkable
class Engine(Protocol):
    """A language model that streams text for chat messages with images."""

    model_id: str
    hidden_size: int  # width of the visual tokens it accepts
    context_tokens: int  # positions the model takes: prompt and answer together

    @property
    def ready(self) -> bool: ...

    @property
    def capabilities(self) -> EngineCapabilities:
        """What it takes and does besides `generate` (see `EngineCapabilities`)."""

    async def start(self) -> None:
        """Load and warm up; `ready` is true afterwards."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        """Stream `TextDelta`s, then exactly one `GenerationResult` per choice
        (`sampling.n`; `index` tells choices apart); the stream ends after the last result.

        Raises `EngineBusy` (on first iteration) when its queue is full. Closing the iterator
        early, or setting `request.cancel`, stops generation within one decode step.
        """

    def count_tokens(self, text: str) -> int: ...

    def forget(self, kv_key: str) -> None:
        """Drop any KV state kept under `kv_key`."""

    def stats(self) -> EngineStats:
        """Scheduler gauges (running, waiting, KV blocks, preemptions)."""

    async def warm_up(self, request: GenerationRequest) -> WarmUpResult:
        """Prefill `request`'s prompt into the KV cache for `request.kv_key`'s next turn,
        generating nothing. Never raises for the request's sake: how it ended is the result
        ("failed" from an engine whose capabilities say it cannot warm up)."""

    def bind_telemetry(self, telemetry: Any) -> None:
        """Take the gateway's `Telemetry` (its tracer and metrics) for the engine's own spans
        and instruments; an engine with none of its own does nothing."""

    async def aclose(self) -> None: ...
