"""The local engine: a transformers model in-process, serving many requests at once.

`LocalEngine` is the `Engine` protocol's async face over `gateway.engine.local.scheduler`, which
runs
iteration-level (continuous) batching on one thread: requests join and leave the batch between
steps, prompts are prefilled in chunks under a per-step token budget beside the running decodes,
and KV is reused by content (automatic prefix caching, per API-key namespace) and pinned per
session, with spill to Redis for other replicas. Text deltas cross to the caller's event loop
through `loop.call_soon_threadsafe`; closing the iterator early cancels the request, which
leaves the batch at the next step. A request for n choices streams their deltas interleaved
(each tagged with its index) and ends after the n-th result; an error in any choice ends the
stream and stops the others.

Why not transformers' own continuous batching (`transformers.generation.continuous_batching`:
a manager thread, a paged cache, prefix block sharing)? It schedules token ids only: a request
cannot bring visual-token embedding rows at arbitrary positions, 3-D M-RoPE positions, or KV
restored from another replica, and its outputs are plain token lists without our streaming
detokenizer, stop strings or per-request seeds. Wrapping it would mean patching its request
and cache internals, which change from release to release. The scheduler here keeps the
checkpoint's own decoder layers (transformers' modules run unchanged) and replaces only where
keys/values live and which keys each query attends to (`gateway.engine.local.batch`), which is the
part that batching needs and the part that stays small enough to read in one sitting.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog
import torch

from encoder_worker.checkpoint import checkpoint_id
from gateway.engine.interface import (
    Delta,
    EngineBusy,
    EngineCapabilities,
    EngineError,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    Message,
    SamplingParams,
    WarmUpResult,
)
from gateway.engine.local.batch import cache_param, install_attention
from gateway.engine.local.grammar import TokenVocab
from gateway.engine.local.kv.blocks import chain_seed
from gateway.engine.local.kv.store import KVStore
from gateway.engine.local.scheduler import Scheduler
from gateway.engine.local.sequence import Job, SchedulerConfig, ms
from gateway.engine.local.weights import LoadedModel, load_weights

__all__ = ("LocalEngine",)

log = structlog.get_logger(__name__)

MiB = 1 << 20


def _embedding_rms(w: LoadedModel) -> float:
    """RMS of the input embedding table, float64 and 8 digits: the same value whatever the thread
    count, since workers started elsewhere must compute the same encoder fingerprint from it."""
    torch.set_num_threads(1)  # off the engine's thread: see LocalEngine._load
    table = w.embed.weight.detach().float()  # [vocab, H]
    return round(float(table.double().pow(2).mean().sqrt()), 8)


def _no_tensor_whole(_key: str) -> bool:
    return False


def kv_numerics(w: LoadedModel) -> str:
    """What a replica's KV values depend on besides the checkpoint: its precision, and whether
    the fused step computes them (its int8 is weight-only, the modules' int8 quantizes the
    activations too), so replicas that share a Redis never take each other's KV across the two."""
    return f"{w.weights}+fused" if w.fused is not None else w.weights


class LocalEngine:
    """Engine protocol over a local HF model (default: the embedded SmolLM2-135M-Instruct)."""

    def __init__(
        self,
        model_path: str | None = None,
        cache_dir: str | None = None,
        max_queue: int = 256,
        max_queue_per_key: int = 0,
        kv_budget_bytes: int = 256 * MiB,
        kv_block_size: int = 16,
        kv_spill_redis_url: str | None = None,
        kv_ttl_s: int = 3600,
        device: str = "auto",
        torch_threads: int | Callable[[], int] | None = None,
        dtype: str = "auto",
        max_batch: int = 16,
        prefill_chunk_tokens: int = 256,
        prefix_caching: bool = True,
    ) -> None:
        if kv_block_size < 1:
            raise ValueError("kv_block_size must be >= 1")
        if max_batch < 1 or max_queue < 1:
            raise ValueError("max_batch and max_queue must be >= 1")
        if max_queue_per_key < 0:
            raise ValueError("max_queue_per_key must be >= 0 (0: automatic)")
        if prefill_chunk_tokens < max_batch:
            raise ValueError("prefill_chunk_tokens must be >= max_batch (one token per decode)")
        self._model_path = model_path
        self._cache_dir = cache_dir
        self._max_queue = max_queue
        self._max_queue_per_key = max_queue_per_key  # 0: a quarter of the queue, at least 4
        self._kv_budget_bytes = kv_budget_bytes
        self._kv_block_size = kv_block_size
        self._kv_redis_url = kv_spill_redis_url
        self._kv_ttl_s = kv_ttl_s
        self._device = device
        # intra-op threads of the scheduler's thread (torch keeps them per thread): a count,
        # a function asked before each step (the gateway's core share), or None: the default
        self._torch_threads = torch_threads
        self._dtype = dtype
        self._max_batch = max_batch
        self._prefill_chunk_tokens = prefill_chunk_tokens
        self._prefix_caching = prefix_caching
        self.model_id = (
            "SmolLM2-135M-Instruct"
            if model_path is None
            else str(model_path).rstrip("/").split("/")[-1]
        )
        self.hidden_size = 576 if model_path is None else 0  # set from the config on start
        self.context_tokens = 8192  # set from the config on start
        self.embedding_rms = 0.0  # RMS of the token-embedding rows; set on start
        self.kv_store: KVStore | None = None
        self._weights: LoadedModel | None = None
        self._vocab: TokenVocab | None = None  # llguidance's view of the tokenizer, with weights
        self._count_tokenizer: Any = None
        self._scheduler: Scheduler | None = None
        self._ready = False
        self._closed = False
        # a warm-up with prefix caching off answers "dropped"
        self._capabilities = EngineCapabilities(image_input="embeds", warm_up=True)

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def capabilities(self) -> EngineCapabilities:
        """Visual tokens from the gateway's encoder and KV warm-ups; once started, the
        embedding RMS and the tokenizer's size too."""
        return self._capabilities

    def bind_telemetry(self, telemetry: Any) -> None:
        """Nothing to bind: the scheduler's gauges are read through `stats`."""

    @property
    def max_queue_per_key(self) -> int:
        """Requests of one owner (API key) that may wait beyond the batch's free slots."""
        per_key = self._max_queue_per_key or max(4, self._max_queue // 4)
        return min(per_key, self._max_queue)

    @property
    def device(self) -> Any:
        return self._weights.device if self._weights is not None else "cpu"

    def replica(self, **overrides: Any) -> LocalEngine:
        """A new, unstarted engine sharing this one's loaded weights (its own queue and KV)."""
        if self._weights is None:
            raise EngineError("start the engine before making a replica", code="not_ready")
        args = {
            "model_path": self._model_path,
            "cache_dir": self._cache_dir,
            "max_queue": self._max_queue,
            "max_queue_per_key": self._max_queue_per_key,
            "kv_budget_bytes": self._kv_budget_bytes,
            "kv_block_size": self._kv_block_size,
            "kv_spill_redis_url": self._kv_redis_url,
            "kv_ttl_s": self._kv_ttl_s,
            "device": self._device,
            "torch_threads": self._torch_threads,
            "dtype": self._dtype,
            "max_batch": self._max_batch,
            "prefill_chunk_tokens": self._prefill_chunk_tokens,
            "prefix_caching": self._prefix_caching,
        }
        args.update(overrides)
        twin = LocalEngine(**args)
        twin._weights, twin._vocab = self._weights, self._vocab
        return twin

    def _load(self) -> LoadedModel:
        # On one intra-op thread: a thread that ever ran torch's parallel regions with more keeps
        # a team of OpenMP workers, and while another team exists libgomp's workers stop
        # spinning between regions, so every parallel region of the engine's own thread pays a
        # wake-up (measured: a float16 decode step on 2 threads, 18.9 ms alone, 34 ms beside an
        # idle team of another thread). The step's thread is the only one that needs more.
        torch.set_num_threads(1)
        return load_weights(self._model_path, self._cache_dir, self._device, self._dtype)

    async def start(self) -> None:
        if self._ready:
            return
        if self._closed:
            raise EngineError("engine is closed", code="closed")
        if self._weights is None:
            self._weights = await asyncio.to_thread(self._load)
        w = self._weights
        install_attention(w.model)
        self.model_id = w.model_id
        self.hidden_size = w.hidden_size
        self.embedding_rms = await asyncio.to_thread(_embedding_rms, w)
        text_config = w.model.config.get_text_config()
        max_positions = int(getattr(text_config, "max_position_embeddings", 0) or 1 << 30)
        self.context_tokens = max_positions
        self._capabilities = EngineCapabilities(
            image_input="embeds",
            warm_up=True,
            embedding_rms=self.embedding_rms,
            vocab_size=len(w.tokenizer),
        )
        # the async side counts tokens; a Rust tokenizer is not safe to share across threads
        self._count_tokenizer = copy.deepcopy(w.tokenizer)
        spill_seed = None
        if self._kv_redis_url is not None:  # KV leaves the process: name the weights themselves
            # configs, safetensors headers and 4 KiB samples of every tensor: cheap at any size
            weights_id = await asyncio.to_thread(
                checkpoint_id, w.path, _no_tensor_whole, sample_others=4096
            )
            spill_seed = chain_seed(
                w.model_id, f"{kv_numerics(w)}|{weights_id}", self._kv_block_size
            )
        self.kv_store = self._make_store(spill_seed)
        eos_ids = self._stop_ids(w)
        if self._vocab is None:  # its build (a second or so) runs while the engine warms up
            self._vocab = TokenVocab(w.tokenizer, eos_ids)
        self._scheduler = Scheduler(
            w,
            SchedulerConfig(
                max_batch=self._max_batch,
                max_queue=self._max_queue,
                max_queue_per_key=self.max_queue_per_key,
                prefill_chunk_tokens=self._prefill_chunk_tokens,
                kv_budget_bytes=self._kv_budget_bytes,
                block_size=self._kv_block_size,
                prefix_caching=self._prefix_caching,
            ),
            eos_ids=eos_ids,
            max_positions=max_positions,
            kv_store=self.kv_store,
            cache_arg=cache_param(w.decoder),
            torch_threads=self._torch_threads,
            name=f"engine-{w.model_id}",
            spill_seed=spill_seed,
            vocab=self._vocab,
        )
        self._scheduler.start()
        warm = GenerationRequest(
            "warmup", [Message("user", ["Hi"])], SamplingParams(max_output_tokens=2)
        )
        started = time.perf_counter()
        async for _ in self._stream(warm):
            pass
        self._scheduler.clear_kv()  # no warm-up KV kept
        await asyncio.to_thread(self._scheduler.barrier, 30.0)
        self._ready = True
        log.info(
            "engine.ready",
            model_id=self.model_id,
            warmup_ms=ms(time.perf_counter() - started),
            max_batch=self._max_batch,
            prefill_chunk_tokens=self._prefill_chunk_tokens,
            kv_budget_bytes=self._kv_budget_bytes,
            prefix_caching=self._prefix_caching,
        )

    def _make_store(self, seed: bytes | None) -> KVStore | None:
        """Where sessions' KV is spilled for other replicas; None: memory only.

        Entries carry `seed` (model id, dtype, block size and the weights' content id), so a
        replica serving other weights under the same name (a new fine-tune deployed at the same
        path) reads a miss, never KV its model did not compute."""
        if self._kv_redis_url is None or seed is None:
            return None
        from gateway.engine.local.kv.redis_store import RedisKVStore

        w = self._weights
        assert w is not None
        return RedisKVStore(
            self._kv_redis_url,
            seed=seed,
            ttl_s=self._kv_ttl_s,
            device=w.device,
        )

    @staticmethod
    def _stop_ids(w: LoadedModel) -> frozenset[int]:
        ids: set[int] = set()
        for source in (
            w.tokenizer.eos_token_id,
            getattr(getattr(w.model, "generation_config", None), "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(i) for i in source)
        for name in ("<|im_end|>", "<end_of_utterance>"):
            tid = w.tokenizer.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != w.tokenizer.unk_token_id:
                ids.add(tid)
        return frozenset(ids)

    async def aclose(self) -> None:
        self._closed = True
        self._ready = False
        if self._scheduler is not None:
            await asyncio.to_thread(self._scheduler.stop)
            self._scheduler = None
        if self.kv_store is not None:
            await asyncio.to_thread(self.kv_store.close)

    async def flush_kv(self, timeout: float = 30.0) -> bool:  # noqa: ASYNC109 - a bounded wait
        """Wait until finished requests' KV is in the prefix cache and written to Redis (if any)."""

        def wait() -> bool:
            deadline = time.monotonic() + timeout
            sched = self._scheduler
            if sched is not None and not sched.barrier(timeout):
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

    # stats and forget may run on other threads while aclose drops the scheduler: read it once

    def stats(self) -> EngineStats:
        sched = self._scheduler
        return sched.stats() if sched is not None else EngineStats()

    def forget(self, kv_key: str) -> None:
        """Drop the KV kept under `kv_key` (pins, memory and Redis), e.g. with its session."""
        sched, store = self._scheduler, self.kv_store
        if sched is not None:
            sched.forget(kv_key)  # its KV memory drops the spilled entry too
        elif store is not None:
            store.delete(kv_key)

    # -- the async side ----------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        sched = self._scheduler
        if sched is None or self._closed:
            raise EngineError("engine not started", code="not_ready")
        job = Job(request, asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter())
        refused = sched.submit(job)
        if refused is not None:
            raise EngineBusy(refused, retry_after_s=self._retry_after())
        left = request.sampling.n  # one result per choice ends the stream
        try:
            while left:
                item = await job.out.get()
                job.taken += 1
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, GenerationResult):
                    left -= 1
                yield item
        finally:
            if left:  # closed early, or one choice failed: the others stop too
                request.cancel.set()

    async def warm_up(self, request: GenerationRequest) -> WarmUpResult:
        """Prefill `request`'s prompt (rendered as `request.warm_up` says; "message" if unset)
        into the prefix cache as background work, pinned for `request.kv_key`, so the session's
        next request prefills only what follows. Lowest priority: it never delays a request
        (see `gateway.engine.local.kv_warmup`), and is dropped first under KV pressure. Never
        raises for the request's sake: how it ended is the result."""
        sched = self._scheduler
        if sched is None or self._closed:
            return WarmUpResult("failed", reason="engine not started")
        if request.kv_key is None:
            return WarmUpResult("failed", reason="a warm-up needs the session's kv_key")
        if not self._prefix_caching:  # nothing computed ahead could be kept
            return WarmUpResult("dropped", reason="prefix caching is off")
        if request.warm_up is None:
            request.warm_up = "message"
        job = Job(request, asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter())
        try:
            sched.submit_warmup(job)
        except EngineError as exc:
            return WarmUpResult("failed", reason=str(exc))
        try:
            item = await job.out.get()
        except asyncio.CancelledError:
            request.cancel.set()
            raise
        if isinstance(item, BaseException):
            return WarmUpResult("failed", reason=str(item))
        return item

    def _retry_after(self) -> float:
        """A hint for a refused client: roughly how long the queue ahead takes to drain."""
        stats = self.stats()
        return float(min(30, max(1, (stats.waiting + stats.running) // max(self._max_batch, 1))))
