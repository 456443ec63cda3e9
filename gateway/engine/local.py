"""The local engine: a transformers causal LM run in-process on one worker thread.

One generation runs at a time per engine; up to `max_queue` more wait, past that `generate`
raises `EngineBusy`. Text deltas cross to the caller's event loop through
`loop.call_soon_threadsafe`. The caller's `request.cancel` is checked before every decode step;
closing the iterator early sets it, so the thread is free within one step.

With a `kv_key`, the KV of each turn (prompt + answer, re-aligned to how the chat template will
render that answer in the next turn's history) is kept in a `KVStore`; the next turn prefills
only the positions after the longest common prefix, verified by block hashes. That changes how
long a turn takes, never its tokens.
"""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from gateway.engine.base import (
    Delta,
    EngineBusy,
    EngineError,
    GenerationRequest,
    GenerationResult,
    ImageInput,
    Message,
    SamplingParams,
    TextDelta,
)
from gateway.engine.generation import (
    StreamDecoder,
    cache_kwarg,
    decode_one_token,
    make_cache,
    prefill,
    sample_next,
)
from gateway.engine.kvblocks import KVEntry, block_hashes, chain_seed, common_prefix, position_keys
from gateway.engine.kvstore import KVStore, MemoryKVStore
from gateway.engine.prompt import Prompt, embed_positions, render
from gateway.engine.weights import LoadedModel, load_weights

__all__ = ("LocalEngine",)

log = structlog.get_logger(__name__)

MiB = 1 << 20
_STOP = object()  # tells the worker thread to exit


@dataclass(slots=True)
class _Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any]
    enqueued: float

    def post(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the caller's loop is gone: nobody is listening
            self.request.cancel.set()


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


class LocalEngine:
    """Engine protocol over a local HF causal LM (default: the embedded SmolLM2-135M-Instruct)."""

    def __init__(
        self,
        model_path: str | None = None,
        cache_dir: str | None = None,
        max_queue: int = 8,
        kv_budget_bytes: int = 256 * MiB,
        kv_block_size: int = 16,
        kv_spill_redis_url: str | None = None,
        kv_ttl_s: int = 3600,
        device: str = "auto",
        torch_threads: int | None = None,
        dtype: str = "auto",
    ) -> None:
        if kv_block_size < 1:
            raise ValueError("kv_block_size must be >= 1")
        self._model_path = model_path
        self._cache_dir = cache_dir
        self._max_queue = max_queue
        self._kv_budget_bytes = kv_budget_bytes
        self._kv_block_size = kv_block_size
        self._kv_redis_url = kv_spill_redis_url
        self._kv_ttl_s = kv_ttl_s
        self._device = device
        # intra-op threads are process-wide in torch; None leaves the process setting alone
        self._torch_threads = torch_threads
        self._dtype = dtype
        self.model_id = (
            "SmolLM2-135M-Instruct"
            if model_path is None
            else str(model_path).rstrip("/").split("/")[-1]
        )
        self.hidden_size = 576 if model_path is None else 0  # set from the config on start
        self.embedding_rms = 0.0  # RMS of the token-embedding rows; set on start
        self.kv_store: KVStore | None = None
        self._weights: LoadedModel | None = None
        self._count_tokenizer: Any = None
        self._max_positions = 1 << 30
        self._jobs: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        self._ready = False
        self._closed = False
        self._running: GenerationRequest | None = None
        self._keeping = 0  # turns whose KV is being stored (after their result went out)
        self._keep_done = threading.Condition()
        self._eos_ids: frozenset[int] = frozenset()
        self._seed = b""

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready

    def replica(self, **overrides: Any) -> LocalEngine:
        """A new, unstarted engine sharing this one's loaded weights (its own queue and KV store)."""
        if self._weights is None:
            raise EngineError("start the engine before making a replica", code="not_ready")
        args = {
            "model_path": self._model_path,
            "cache_dir": self._cache_dir,
            "max_queue": self._max_queue,
            "kv_budget_bytes": self._kv_budget_bytes,
            "kv_block_size": self._kv_block_size,
            "kv_spill_redis_url": self._kv_redis_url,
            "kv_ttl_s": self._kv_ttl_s,
            "device": self._device,
            "torch_threads": self._torch_threads,
            "dtype": self._dtype,
        }
        args.update(overrides)
        twin = LocalEngine(**args)
        twin._weights = self._weights
        return twin

    async def start(self) -> None:
        if self._ready:
            return
        if self._closed:
            raise EngineError("engine is closed", code="closed")
        if self._torch_threads is not None:
            torch.set_num_threads(self._torch_threads)
        if self._weights is None:
            self._weights = await asyncio.to_thread(
                load_weights, self._model_path, self._cache_dir, self._device, self._dtype
            )
        w = self._weights
        self.model_id = w.model_id
        self.hidden_size = w.hidden_size
        table = w.model.get_input_embeddings().weight.detach().float()  # [vocab, H]
        self.embedding_rms = float(table.pow(2).mean().sqrt())
        self._eos_ids = self._stop_ids(w)
        text_config = w.model.config.get_text_config()
        self._max_positions = int(getattr(text_config, "max_position_embeddings", 0) or 1 << 30)
        # the worker thread uses the tokenizer; a Rust tokenizer is not safe to share across threads
        self._count_tokenizer = copy.deepcopy(w.tokenizer)
        dtype_name = w.weights  # KV made with other weights never matches
        self._seed = chain_seed(w.model_id, dtype_name, self._kv_block_size)
        self._cache_arg = cache_kwarg(w.model)
        self.kv_store = self._make_store()
        self._thread = threading.Thread(
            target=self._worker, name=f"engine-{w.model_id}", daemon=True
        )
        self._thread.start()
        warm = GenerationRequest(
            "warmup", [Message("user", ["Hi"])], SamplingParams(max_output_tokens=2)
        )
        started = time.perf_counter()
        async for _ in self._stream(warm):
            pass
        self._ready = True
        log.info(
            "engine.ready", model_id=self.model_id, warmup_ms=_ms(time.perf_counter() - started)
        )

    def _make_store(self) -> KVStore:
        if self._kv_redis_url is None:
            return MemoryKVStore(self._kv_budget_bytes)
        from gateway.engine.kvredis import RedisKVStore

        return RedisKVStore(
            self._kv_redis_url,
            self._kv_budget_bytes,
            seed=self._seed,
            ttl_s=self._kv_ttl_s,
            device=self._weights.device if self._weights is not None else "cpu",
        )

    @staticmethod
    def _stop_ids(w: LoadedModel) -> frozenset[int]:
        ids: set[int] = set()
        for source in (
            w.tokenizer.eos_token_id,
            getattr(w.model.generation_config, "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(i) for i in source)
        im_end = w.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != w.tokenizer.unk_token_id:
            ids.add(im_end)
        return frozenset(ids)

    async def aclose(self) -> None:
        self._closed = True
        self._ready = False
        if self._running is not None:
            self._running.cancel.set()
        if self._thread is not None:
            while True:  # fail whatever still waits, then stop the thread
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if isinstance(job, _Job):
                    job.post(EngineError("engine closed", code="closed"))
            await asyncio.to_thread(self._jobs.put, _STOP)
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self.kv_store is not None:
            await asyncio.to_thread(self.kv_store.close)

    async def flush_kv(self, timeout: float = 30.0) -> bool:
        """Wait until finished turns are in the KV store and written to Redis (if any).

        A turn's KV is stored just after its result is sent, and written to Redis behind that.
        """

        def wait() -> bool:
            deadline = time.monotonic() + timeout
            with self._keep_done:
                if not self._keep_done.wait_for(lambda: self._keeping == 0, timeout):
                    return False
            store = self.kv_store
            return store is None or store.flush(max(0.0, deadline - time.monotonic()))

        return await asyncio.to_thread(wait)

    def count_tokens(self, text: str) -> int:
        if self._count_tokenizer is None:
            raise EngineError("engine not started", code="not_ready")
        return len(self._count_tokenizer(text, add_special_tokens=False)["input_ids"])

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (with its chat template); None before `start`."""
        return self._weights.tokenizer if self._weights is not None else None

    # -- the async side ----------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        if self._thread is None or self._closed:
            raise EngineError("engine not started", code="not_ready")
        job = _Job(request, asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter())
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise EngineBusy(f"engine queue is full ({self._max_queue} waiting)") from None
        finished = False
        try:
            while True:
                item = await job.out.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if isinstance(item, GenerationResult):
                    finished = True
                    return
        finally:
            if not finished:
                request.cancel.set()

    # -- the worker thread -------------------------------------------------------------------

    def _worker(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            req = job.request
            picked = time.perf_counter()
            queue_ms = _ms(picked - job.enqueued)
            if req.cancel.is_set():
                job.post(GenerationResult("", "cancelled", 0, 0, 0, queue_ms=queue_ms))
                continue
            self._running = req
            try:
                with torch.inference_mode():
                    self._run(job, picked, queue_ms)
            except EngineError as exc:
                job.post(exc)
            except Exception as exc:  # the thread must outlive any one request
                log.exception("engine.generate_failed", request_id=req.request_id)
                job.post(EngineError(f"generation failed: {exc}"))
            finally:
                self._running = None

    def _run(self, job: _Job, picked: float, queue_ms: float) -> None:
        w = self._weights
        assert w is not None
        req, sp = job.request, job.request.sampling
        image_keys: dict[int, str] = {}
        for message in req.messages:
            for part in message.content:
                if isinstance(part, ImageInput) and (
                    part.embeds.ndim != 2 or part.embeds.shape[1] != self.hidden_size
                ):
                    raise EngineError(
                        f"image embeds must be [N, {self.hidden_size}], got {tuple(part.embeds.shape)}",
                        code="invalid_image",
                    )
        prompt = render(
            w.tokenizer, req.messages, add_generation_prompt=True, image_keys=image_keys
        )
        if prompt.length == 0:
            raise EngineError("empty prompt", code="invalid_request")
        if prompt.length >= self._max_positions:
            raise EngineError(
                f"prompt is {prompt.length} tokens; the model takes {self._max_positions}",
                code="context_length_exceeded",
            )
        max_new = min(sp.max_output_tokens, self._max_positions - prompt.length)

        cached, layers = self._lookup(req.kv_key, prompt)
        cache = make_cache(w.model, layers)
        started = time.perf_counter()
        embeds = embed_positions(w.model.get_input_embeddings(), prompt, cached, w.dtype, w.device)
        logits = prefill(
            w.model, cache, embeds, cache_arg=self._cache_arg, should_stop=req.cancel.is_set
        )
        prefill_done = time.perf_counter()

        generator = None
        if sp.temperature > 0.0:
            generator = torch.Generator(device="cpu")
            if sp.seed is not None:
                generator.manual_seed(sp.seed)
            else:
                generator.seed()
        decoder = StreamDecoder(
            lambda ids: w.tokenizer.decode(
                ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
            ),
            sp.stop,
        )
        generated: list[int] = []
        first_delta: float | None = None
        finish = "length"
        while True:
            if logits is None or req.cancel.is_set():
                finish = "cancelled"
                break
            if len(generated) >= max_new:
                finish = "length"
                break
            token = sample_next(logits, sp.temperature, sp.top_p, generator)
            generated.append(token)
            if token in self._eos_ids:
                finish = "stop"
                break
            delta = decoder.push(token)
            if delta:
                job.post(TextDelta(delta))
                if first_delta is None:
                    first_delta = time.perf_counter()
            if decoder.stopped:
                finish = "stop"
                break
            if len(generated) >= max_new:
                finish = "length"
                break
            if req.cancel.is_set():
                finish = "cancelled"
                break
            logits = decode_one_token(w.model, cache, token, cache_arg=self._cache_arg)
        tail = decoder.finish()
        if tail:
            job.post(TextDelta(tail))
            if first_delta is None:
                first_delta = time.perf_counter()
        done = time.perf_counter()
        result = GenerationResult(
            text=decoder.text,
            finish_reason=finish,  # type: ignore[arg-type]
            input_tokens=prompt.length,
            image_tokens=prompt.image_tokens,
            output_tokens=len(generated),
            cached_tokens=cached,
            cached_image_tokens=sum(max(0, min(span.start + span.length, cached) - span.start)
                                    for span in prompt.images),
            queue_ms=queue_ms,
            prefill_ms=_ms(prefill_done - started),
            decode_ms=_ms(done - prefill_done),
            ttft_ms=_ms((first_delta or done) - picked),
        )
        keep = req.kv_key is not None and self.kv_store is not None
        if keep:
            with self._keep_done:
                self._keeping += 1
        job.post(result)
        log.info(
            "engine.generated",
            request_id=req.request_id,
            finish_reason=finish,
            input_tokens=result.input_tokens,
            cached_tokens=cached,
            output_tokens=result.output_tokens,
            prefill_ms=result.prefill_ms,
            decode_ms=result.decode_ms,
        )
        if keep:
            try:
                self._keep(req, prompt, generated, cache, decoder.text, image_keys)
            except Exception:  # losing a cache entry costs speed only
                log.exception("kv.keep_failed", kv_key=req.kv_key)
            finally:
                with self._keep_done:
                    self._keeping -= 1
                    self._keep_done.notify_all()

    # -- KV reuse ----------------------------------------------------------------------------

    def forget(self, kv_key: str) -> None:
        """Drop the KV kept under `kv_key` (memory and Redis), e.g. when its session is deleted."""
        if self.kv_store is not None:
            self.kv_store.delete(kv_key)

    def _lookup(
        self, kv_key: str | None, prompt: Prompt
    ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """Positions of `prompt` whose KV is reusable, and those KV tensors (sliced)."""
        if kv_key is None or self.kv_store is None:
            return 0, None
        hashes = block_hashes(prompt.tokens, prompt.images, self._kv_block_size, self._seed)
        entry = self.kv_store.get(kv_key, hashes)
        if entry is None:
            return 0, None
        # at least one position is always prefilled: its logits start the answer
        n = min(entry.reusable(prompt.tokens, prompt.images, hashes), prompt.length - 1)
        if n <= 0:
            return 0, None
        return n, [(k[:, :, :n], v[:, :, :n]) for k, v in entry.layers]

    def _keep(
        self,
        req: GenerationRequest,
        prompt: Prompt,
        generated: list[int],
        cache: Any,
        answer: str,
        image_keys: dict[int, str],
    ) -> None:
        """Store this turn's KV for the positions the next turn's prompt will share with it.

        The next turn's prompt holds `answer` re-rendered by the chat template and re-tokenized
        (plus the end-of-turn tokens), which need not be the ids that were sampled. So the KV
        is cropped to where the two agree, and no forward pass runs here: the few positions
        after that (usually the end-of-turn tokens) are prefilled with the next turn's new
        words, where one more token costs next to nothing. Keeping this step free of model work
        keeps it off the next request's critical path, and the next turn's tokens are still
        exactly those an uncached run would see.
        """
        w = self._weights
        assert w is not None and self.kv_store is not None
        started = time.perf_counter()
        have_len = cache.get_seq_length()
        have_tokens = (prompt.tokens + generated)[:have_len]
        history = [*req.messages, Message("assistant", [answer])]
        target = render(w.tokenizer, history, add_generation_prompt=False, image_keys=image_keys)
        keep = common_prefix(
            (),
            position_keys(have_tokens, prompt.images),
            (),
            position_keys(target.tokens, target.images),
            1,
        )
        # an image is kept whole or not at all
        for span in target.images:
            if span.start < keep < span.start + span.length:
                keep = span.start
        if keep <= 0:
            return
        tokens = target.tokens[:keep]
        images = [span for span in target.images if span.start + span.length <= keep]
        layers = [(layer.keys[:, :, :keep].contiguous(), layer.values[:, :, :keep].contiguous())
                  for layer in cache.layers]
        hashes = block_hashes(tokens, images, self._kv_block_size, self._seed)
        entry = KVEntry(tokens, images, self._kv_block_size, hashes, layers)
        self.kv_store.put(req.kv_key, entry)  # type: ignore[arg-type]
        log.debug(
            "kv.kept",
            kv_key=req.kv_key,
            positions=entry.length,
            left_to_prefill=target.length - keep,
            nbytes=entry.nbytes,
            ms=_ms(time.perf_counter() - started),
        )
