"""`LocalEncoder`: the in-process `Encoder` (types.py) with dynamic micro-batching.

`encode()` computes nothing on the event loop: it parks the bytes and a future on a queue. One
batching task takes the first waiting request, gathers whatever else arrives within
`max_wait_ms` (up to the pipeline's `batch_limit`: `max_batch` on an accelerator, `cpu_batch`,
default 1, on a CPU, where images run one by one inside a batch anyway), and hands the batch to
`EncoderPipeline.encode_batch` on a single worker thread. Each caller gets its own result or
its own `ImageError`; if the batch call itself fails unexpectedly, the images are retried one
by one so only the culprit fails.
While a batch runs, new requests queue up and form the next batch.

The queue is fair between owners (`encode(..., owner=)`, an opaque string; the gateway passes
the API key's owner id): waiting images are taken round-robin by owner (`EncodeJobQueue`), not
in arrival order, so one owner's 64 images do not make another owner's one image wait for all
of them; it waits at most for the batch running and one image of each other owner.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext

import structlog
import torch

from encoder_worker.config import EncoderConfig
from encoder_worker.pipeline import EncoderPipeline, budget_config, encoder_fingerprint
from encoder_worker.types import EncodedImage, ImageError

__all__ = ("EncodeJobQueue", "LocalEncoder")

log = structlog.get_logger("encoder_worker.local_encoder")

# (image bytes, the caller's future, the keep-ratio cap it is encoded under; None: the config's)
_Job = tuple[bytes, "asyncio.Future[EncodedImage]", "float | None"]


class EncodeJobQueue:
    """Jobs waiting for the encoder, taken round-robin by owner.

    Each owner with jobs waiting has a lane (FIFO within it); `get` takes the head of the lane
    at the front of the rotation and sends that lane to the back. A new owner joins at the back;
    an owner whose lane empties leaves the rotation. So among the owners waiting, each gets one
    job per round, whoever queued first or most. Jobs of owner None share one lane. One event
    loop, any number of producers, one consumer.
    """

    __slots__ = ("_lanes", "_nonempty", "_size")

    def __init__(self) -> None:
        self._lanes: OrderedDict[str | None, deque[_Job]] = OrderedDict()
        self._size = 0
        self._nonempty = asyncio.Event()

    def qsize(self) -> int:
        return self._size

    def empty(self) -> bool:
        return self._size == 0

    def put_nowait(self, owner: str | None, job: _Job) -> None:
        lane = self._lanes.get(owner)
        if lane is None:
            lane = self._lanes[owner] = deque()  # joins the rotation at the back
        lane.append(job)
        self._size += 1
        self._nonempty.set()

    def get_nowait(self) -> _Job:
        """The next job in turn; IndexError when none waits."""
        if not self._lanes:
            raise IndexError("no job waiting")
        owner, lane = next(iter(self._lanes.items()))
        job = lane.popleft()
        if lane:
            self._lanes.move_to_end(owner)
        else:
            del self._lanes[owner]
        self._size -= 1
        if self._size == 0:
            self._nonempty.clear()
        return job

    async def get(self) -> _Job:
        while self._size == 0:
            await self._nonempty.wait()
        return self.get_nowait()

    def drain(self) -> list[_Job]:
        """Every waiting job, taken out."""
        jobs = [job for lane in self._lanes.values() for job in lane]
        self._lanes.clear()
        self._size = 0
        self._nonempty.clear()
        return jobs


class LocalEncoder:
    """Encoder protocol implementation running `EncoderPipeline` on a worker thread."""

    remote = False

    def __init__(
        self,
        config: EncoderConfig,
        hidden_size: int | None,
        target_rms: float | None = None,
        *,
        torch_threads: int | None = None,
        on_batch: Callable[[], AbstractContextManager[object]] | None = None,
    ) -> None:
        """`hidden_size` / `target_rms`: the language model's, for the synthetic projector; a
        VLM checkpoint (`config.family`) uses its own projector and only checks the width.
        `on_batch`: a context entered around each batch's encode (the gateway's core share)."""
        self.config = config
        self.hidden_size = hidden_size
        self.target_rms = target_rms
        # intra-op threads of the encoder's own thread (torch keeps this per thread): beside an
        # in-process language model the two share the cores instead of fighting over them
        self.torch_threads = torch_threads
        self._on_batch = on_batch or nullcontext
        # known before the tower is built, so caches can be consulted right away
        self.fingerprint = encoder_fingerprint(config, hidden_size, target_rms)
        self.pipeline: EncoderPipeline | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._queue: EncodeJobQueue | None = None
        self._task: asyncio.Task[None] | None = None
        self.batches = 0  # batches run so far (observability and tests)
        self._batch_limit = config.max_batch  # the pipeline's `batch_limit` once built

    async def start(self) -> None:
        """Build the tower and projector off the loop, warm up once, start batching."""
        if self._task is not None:
            return
        loop = asyncio.get_running_loop()
        threads = self.torch_threads
        self._executor = ThreadPoolExecutor(
            1,
            thread_name_prefix="vg-encoder",
            initializer=(lambda: torch.set_num_threads(threads)) if threads else None,
        )
        self.pipeline = await loop.run_in_executor(self._executor, self._build)
        self._batch_limit = self.pipeline.batch_limit
        self._queue = EncodeJobQueue()
        self._task = asyncio.create_task(self._batch_loop(), name="visiongate-encoder-batcher")

    def _build(self) -> EncoderPipeline:
        pipeline = EncoderPipeline(self.config, self.hidden_size, self.target_rms)
        pipeline.warmup()
        return pipeline

    def fingerprint_for(self, max_keep_ratio: float | None) -> str:
        """The fingerprint of tokens encoded with keep ratios capped at `max_keep_ratio`."""
        config = budget_config(self.config, max_keep_ratio)
        if config is self.config:
            return self.fingerprint
        return encoder_fingerprint(config, self.hidden_size, self.target_rms)

    async def encode(
        self,
        data: bytes,
        *,
        traceparent: str | None = None,
        owner: str | None = None,
        max_keep_ratio: float | None = None,
    ) -> EncodedImage:
        """Encode one image (micro-batched with concurrent calls, in turns by `owner`);
        `max_keep_ratio` caps its keep ratio (a smaller visual-token budget, see
        `encoder_worker.pipeline.budget_config`). Raises ImageError."""
        if self._queue is None or self._task is None or self._task.done():
            raise RuntimeError("LocalEncoder is not started (await start() first)")
        if len(data) > self.config.max_image_bytes:
            raise ImageError(
                "image_too_large",
                f"image is {len(data)} bytes; the limit is {self.config.max_image_bytes}",
            )
        fut: asyncio.Future[EncodedImage] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(owner, (bytes(data), fut, max_keep_ratio))
        return await fut

    async def _collect(self) -> list[_Job]:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        batch = [await self._queue.get()]
        deadline = loop.time() + self.config.max_wait_ms / 1e3
        try:
            while len(batch) < self._batch_limit:
                if not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), remaining))
                except TimeoutError:
                    break
        except asyncio.CancelledError:  # closing: the jobs taken off the queue fail, never hang
            for _, fut, _ in batch:
                if not fut.done():
                    fut.set_exception(RuntimeError("encoder closed"))
            raise
        return [job for job in batch if not job[1].done()]  # callers that gave up

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                batch = await self._collect()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the batcher die with callers waiting
                log.exception("encoder.collect_failed")
                continue
            if not batch:
                continue
            caps: dict[float | None, list[_Job]] = {}  # one encode per budget in the batch
            for job in batch:
                caps.setdefault(job[2], []).append(job)
            for cap, jobs in caps.items():
                datas = [data for data, _, _ in jobs]
                try:
                    with self._on_batch():
                        results = await loop.run_in_executor(
                            self._executor, self._encode, datas, cap
                        )
                except asyncio.CancelledError:
                    for _, fut, _ in batch:
                        if not fut.done():
                            fut.set_exception(RuntimeError("encoder closed"))
                    raise
                self.batches += 1
                for (_, fut, _), result in zip(jobs, results, strict=False):
                    if fut.done():
                        continue
                    if isinstance(result, BaseException):
                        fut.set_exception(result)
                    else:
                        fut.set_result(result)

    def _encode(
        self, datas: list[bytes], cap: float | None = None
    ) -> list[EncodedImage | BaseException]:
        assert self.pipeline is not None
        try:
            if cap is None:
                return list(self.pipeline.encode_batch(datas))
            return list(self.pipeline.encode_batch(datas, cap))
        except Exception as exc:
            if len(datas) == 1:
                log.exception("encoder.batch_failed", batch_size=1)
                return [RuntimeError(f"encoding failed: {exc}")]
        log.warning("encoder.batch_failed_retrying_singly", batch_size=len(datas))
        return [self._encode([d], cap)[0] for d in datas]

    async def queue_depth(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    async def aclose(self) -> None:
        """Stop batching, fail whatever is still queued, release the worker thread."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._queue is not None:
            for _, fut, _ in self._queue.drain():
                if not fut.done():
                    fut.set_exception(RuntimeError("encoder closed"))
            self._queue = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
