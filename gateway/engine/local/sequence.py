"""One request as the scheduler sees it, and the per-request work that is not scheduling.

`Sequence` is one choice of a request between steps: its rendered prompt, generated tokens, KV
buffer (`fed` positions computed), sampler, grammar matcher, streaming detokenizer, pending
log-probabilities and timings. A request asking for n > 1 choices is one sequence until its
prompt is prefilled, then n (`gateway.engine.local.choices`). `check_request` refuses what would run
wrongly or cost every other stream; `prepare_sequence` renders the prompt (chat template, or a
raw prompt as is) and sets up sampling and the grammar when the request is first picked up;
`sequence_inputs` builds a step's input embeddings and rotary positions for a run of a
sequence's positions (prompt rows, image rows, generated tokens; 1-D or M-RoPE);
`sequence_result` is the `GenerationResult` it ends with.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gateway.engine.interface import (
    MAX_CHOICES,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TOP_LOGPROBS,
    EngineError,
    GenerationRequest,
    GenerationResult,
    ImageInput,
    ImageInputKind,
)
from gateway.engine.local.generation import LogprobTrail, StreamDecoder
from gateway.engine.local.grammar import MAX_GRAMMAR_CHARS, compile_grammar
from gateway.engine.local.kv.blocks import chain_seed
from gateway.engine.local.prompt import Prompt, embed_positions, render, render_raw

if TYPE_CHECKING:
    from gateway.engine.local.batch import SeqKV
    from gateway.engine.local.grammar import TokenVocab
    from gateway.engine.local.weights import LoadedModel

__all__ = (
    "GROW",
    "Job",
    "SchedulerConfig",
    "Sequence",
    "check_request",
    "choice_generator",
    "ms",
    "new_decoder",
    "prepare_sequence",
    "sequence_inputs",
    "sequence_result",
)

GROW = 64  # positions a sequence's buffer grows by


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


@dataclass(slots=True)
class Job:
    """A request and the way back to its caller's event loop."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any]
    enqueued: float
    posted: int = 0  # items sent towards the caller (the engine thread counts)
    taken: int = 0  # items the caller took (the caller's loop counts)

    def post(self, item: Any) -> None:
        self.posted += 1
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the caller's loop is gone: nobody is listening
            self.request.cancel.set()

    @property
    def unread(self) -> int:
        """Items posted that the caller has not taken yet (read racily: a hint, not a count)."""
        return self.posted - self.taken


@dataclass(slots=True)
class SchedulerConfig:
    max_batch: int = 16
    max_queue: int = 256
    max_queue_per_key: int = 64  # requests of one owner waiting beyond the batch's free slots
    prefill_chunk_tokens: int = 256
    kv_budget_bytes: int = 256 << 20
    block_size: int = 16
    prefix_caching: bool = True
    # a caller this many deltas behind is not reading (a stalled client): generation stops for
    # it with finish reason "slow_reader" instead of running on for nobody
    max_unread_deltas: int = 256
    # positions a KV warm-up feeds in a step with nothing else in the batch: small, so that a
    # request arriving meanwhile waits for a short step
    warmup_chunk_tokens: int = 64


@dataclass(slots=True, eq=False)
class Sequence:
    """One choice of a request in the scheduler: prompt, generated tokens, KV buffer, timings."""

    job: Job
    index: int = 0  # which choice (SamplingParams.n) this sequence samples
    forked: bool = False  # the request's n choices exist (always so when n == 1)
    order: int = 0
    prompt: Prompt | None = None
    image_keys: dict[int, str] = field(default_factory=dict)
    seed: bytes = b""  # prefix-cache chain seed (model, dtype, block size, namespace)
    generated: list[int] = field(default_factory=list)
    kv: SeqKV | None = None
    fed: int = 0
    max_new: int = 0
    cached: int = 0  # prompt positions reused at first admission
    decoder: StreamDecoder | None = None
    generator: torch.Generator | None = None
    matcher: Any = None  # llguidance.LLMatcher of the request's grammar; None: unconstrained
    trail: LogprobTrail | None = None  # None: no log-probabilities asked for
    admitted: float = 0.0
    first_token: float | None = None
    first_delta: float | None = None
    last_delta: float | None = None
    itl: list[float] = field(default_factory=list)
    prefill_chunks: int = 0
    preemptions: int = 0
    held: int = 0  # steps in a row this decoding sequence waited for lighter keys' tokens
    warmed: int = 0  # of `cached`, positions a warm-up of its session computed for it

    @property
    def request(self) -> GenerationRequest:
        return self.job.request

    @property
    def owner(self) -> str | None:
        """Whose share of the engine this request uses: its API key's owner (None: anonymous).
        A client's cache salt narrows the prefix cache, never this."""
        request = self.job.request
        return request.owner if request.owner is not None else request.cache_salt

    @property
    def warm(self) -> bool:
        """A KV warm-up: its prompt is prefilled into the prefix cache, nothing sampled."""
        return self.job.request.warm_up is not None

    @property
    def known(self) -> int:
        assert self.prompt is not None
        return self.prompt.length + len(self.generated)

    @property
    def width(self) -> int:
        """Batch slots this sequence stands for: its request's n until it forks, else one."""
        return 1 if self.forked else self.job.request.sampling.n


def check_request(req: GenerationRequest, hidden: int, images: ImageInputKind = "embeds") -> None:
    """Refuse, with a stable code, what would run wrongly or cost every other stream.
    `images`: what the engine takes for an image (visual tokens, or the original bytes)."""
    if not req.messages and req.raw_prompt is None:
        raise EngineError("messages must not be empty", code="invalid_request")
    for message in req.messages:
        for part in message.content:
            if not isinstance(part, ImageInput):
                continue
            if images == "bytes":
                if not part.data:
                    raise EngineError("an image reached the engine without its bytes")
                continue
            embeds = part.embeds  # [N, hidden]
            if embeds is None:  # the gateway resolves tokens for an engine that takes them
                raise EngineError("an image reached the engine without its visual tokens")
            if embeds.ndim != 2 or embeds.shape[1] != hidden:
                raise EngineError(
                    f"image embeds must be [N, {hidden}], got {tuple(embeds.shape)}",
                    code="invalid_image",
                )
            if not embeds.is_floating_point():
                raise EngineError(
                    f"image embeds must be floating point, got {embeds.dtype}", code="invalid_image"
                )
            # one NaN row reaches every position of its prefill chunk (and the cached blocks)
            if not bool(torch.isfinite(embeds).all()):
                raise EngineError("image embeds hold NaN or infinite values", code="invalid_image")
    sp = req.sampling
    if sp.max_output_tokens < 1:
        raise EngineError("max_output_tokens must be >= 1", code="invalid_request")
    if not (math.isfinite(sp.temperature) and sp.temperature >= 0.0):
        raise EngineError("temperature must be a finite number >= 0", code="invalid_request")
    if not 0.0 < sp.top_p <= 1.0:  # NaN fails too
        raise EngineError("top_p must be in (0, 1]", code="invalid_request")
    if sp.seed is not None and not -(2**63) <= sp.seed < 2**64:  # what a torch.Generator takes
        raise EngineError("seed must be a 64-bit integer", code="invalid_request")
    if not 1 <= sp.n <= MAX_CHOICES:
        raise EngineError(f"n must be in 1..{MAX_CHOICES}", code="invalid_request")
    if sp.logprobs is not None and not 0 <= sp.logprobs <= MAX_TOP_LOGPROBS:
        raise EngineError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}", code="invalid_request")
    if len(sp.stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in sp.stop):
        raise EngineError(
            f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters",
            code="invalid_request",
        )
    if sp.grammar is not None and not sp.grammar.strip():
        raise EngineError("grammar must not be empty", code="invalid_request")
    if sp.grammar is not None and len(sp.grammar) > MAX_GRAMMAR_CHARS:
        raise EngineError(
            f"grammar is longer than {MAX_GRAMMAR_CHARS} characters", code="invalid_request"
        )


def choice_generator(seed: int | None, index: int) -> torch.Generator:
    """The sampler of choice `index`: seeded with seed + index (wrapped to 64 bits), or from
    fresh entropy when the request has no seed."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        seed += index
        generator.manual_seed(seed - 2**64 if seed >= 2**64 else seed)
    return generator


def prepare_sequence(
    seq: Sequence, w: LoadedModel, max_positions: int, block_size: int, vocab: TokenVocab
) -> None:
    """Render the prompt, set up sampling and the grammar; raise EngineError on a bad request."""
    req = seq.request
    check_request(req, w.hidden_size)
    try:
        if req.raw_prompt is not None:
            prompt = render_raw(w.tokenizer, req.raw_prompt)
        else:
            # a warm-up renders what the next turn's prompt starts with: the conversation so
            # far without the generation prompt (and its last message left open for "part")
            prompt = render(
                w.tokenizer,
                req.messages,
                add_generation_prompt=req.warm_up is None,
                image_keys=seq.image_keys,
                open_last=req.warm_up == "part",
            )
    except ValueError as exc:
        raise EngineError(str(exc), code="invalid_request") from None
    if prompt.length == 0:
        raise EngineError("empty prompt", code="invalid_request")
    if prompt.length >= max_positions:
        raise EngineError(
            f"prompt is {prompt.length} tokens; the model takes {max_positions}",
            code="context_length_exceeded",
        )
    sp = req.sampling
    if sp.grammar is not None and req.warm_up is None:
        seq.matcher = compile_grammar(vocab, sp.grammar)
    seq.prompt = prompt  # last of what may fail: a set prompt means the request was accepted
    seq.max_new = min(sp.max_output_tokens, max_positions - prompt.length)
    salt = req.cache_salt or ""
    seq.seed = chain_seed(w.model_id, f"{w.weights}|{salt}", block_size)
    if sp.temperature > 0.0:
        seq.generator = choice_generator(sp.seed, seq.index)
    seq.decoder = new_decoder(w, sp.stop)
    seq.trail = LogprobTrail() if sp.logprobs is not None else None


def new_decoder(w: LoadedModel, stops: tuple[str, ...]) -> StreamDecoder:
    tok = w.tokenizer
    return StreamDecoder(
        lambda ids: tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False),
        stops,
    )


def sequence_inputs(
    w: LoadedModel, seq: Sequence, start: int, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input embeddings [n, H] and rotary positions ([n] or [3, n]) of positions [start, +n)."""
    prompt = seq.prompt
    assert prompt is not None
    end = start + n
    parts = []
    if start < prompt.length:
        parts.append(
            embed_positions(w.embed, prompt, start, w.dtype, w.device, end=min(end, prompt.length))[
                0
            ]
        )
    if end > prompt.length:
        lo = max(start, prompt.length) - prompt.length
        ids = torch.tensor(seq.generated[lo : end - prompt.length], device=w.device)
        parts.append(w.embed(ids).to(w.dtype))
    embeds = parts[0] if len(parts) == 1 else torch.cat(parts)
    if not w.mrope:
        return embeds, torch.arange(start, end, device=w.device)
    mrope = prompt.mrope
    delta = prompt.rope_delta
    cols = []
    if start < prompt.length and mrope is not None:
        cols.append(mrope[:, start : min(end, prompt.length)].to(w.device))
    elif start < prompt.length:
        r = torch.arange(start, min(end, prompt.length), device=w.device)
        cols.append(r.expand(3, -1))
    if end > prompt.length:
        r = torch.arange(max(start, prompt.length), end, device=w.device) + delta
        cols.append(r.expand(3, -1))
    return embeds, torch.cat(cols, dim=1)


def sequence_result(seq: Sequence, finish: str, now: float) -> GenerationResult:
    prompt = seq.prompt
    queue_ms = ms((seq.admitted or now) - seq.job.enqueued)
    if prompt is None:
        return GenerationResult("", finish, 0, 0, 0, queue_ms=queue_ms, index=seq.index)  # type: ignore[arg-type]
    started = seq.admitted or now
    first = seq.first_token or now
    return GenerationResult(
        text=seq.decoder.text if seq.decoder is not None else "",
        finish_reason=finish,  # type: ignore[arg-type]
        input_tokens=prompt.length,
        image_tokens=prompt.image_tokens,
        output_tokens=len(seq.generated),
        cached_tokens=seq.cached,
        cached_image_tokens=sum(
            max(0, min(sp.start + sp.length, seq.cached) - sp.start) for sp in prompt.images
        ),
        queue_ms=queue_ms,
        prefill_ms=ms(first - started),
        decode_ms=ms(now - first),
        ttft_ms=ms((seq.first_delta or now) - started),
        itl_ms=tuple(seq.itl),
        prefill_chunks=seq.prefill_chunks,
        preemptions=seq.preemptions,
        index=seq.index,
        logprobs=seq.trail.rest() if seq.trail is not None else (),
        warmed_tokens=seq.warmed,
    )
