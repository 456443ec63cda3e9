"""The synchronous encoder: a batch of image bytes -> EncodedImage (or ImageError) per image.

    decode (Pillow threads; nvJPEG on CUDA) -> fused resize/normalize/patchify on the device
    -> vision tower up to the feature layer + saliency -> patch dropping -> projector
    -> INT4 payload

`EncoderPipeline` is what `LocalEncoder` runs on its worker thread, what the benchmark drives,
and what a queue-consuming worker process would call. One bad image yields its `ImageError`
in its slot; the rest of the batch is encoded normally.

Same bytes + same config give bit-identical tokens whatever batch they arrive in: matmul
kernels may pick a different blocking for a different number of rows, so every shape an image
sees is fixed. On CPU the tower and projector run image by image (batching buys nothing
measurable there); on CUDA batches are padded to `max_batch`, which is also the fixed shape
`torch.compile`'s CUDA graphs replay.
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import structlog
import torch

from encoder_worker.config import EncoderConfig
from encoder_worker.decode import decode_image, decode_jpeg_cuda, torchvision_jpeg_available
from encoder_worker.payload import quantize_tokens
from encoder_worker.preprocess import preprocess_batch
from encoder_worker.projector import Projector
from encoder_worker.pruning import prune
from encoder_worker.tower import TowerOutput, build_tower, describe_tower
from encoder_worker.types import EncodedImage, ImageError

__all__ = ("EncoderPipeline", "encoder_fingerprint", "resolve_device")

log = structlog.get_logger("encoder_worker.pipeline")
FORMAT_VERSION = 1


def resolve_device(cfg: EncoderConfig) -> tuple[torch.device, torch.dtype]:
    if cfg.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {cfg.device!r} requested but CUDA is not available")
    if cfg.dtype != "auto":
        return device, getattr(torch, cfg.dtype)
    if device.type == "cpu":
        return device, torch.float32
    return device, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def encoder_fingerprint(config: EncoderConfig, hidden_size: int, target_rms: float | None) -> str:
    """sha256 hex over everything that shapes the tokens: weights, preprocessing, feature layer,
    pruning, quantization and projector. Device and dtype are left out on purpose: a GPU and
    a CPU worker share cache entries (their tokens differ only in rounding)."""
    c = config
    info = describe_tower(c.tower, c.seed)
    parts = {
        "format": FORMAT_VERSION,
        "weights": info.weights_id,
        "feature_layer": c.feature_layer,
        "preprocess": msgspec.to_builtins(info.spec),
        "pruning": [c.pruning, c.keep_ratio, c.min_keep_ratio, c.max_keep_ratio,
                    c.saliency_mass, c.merge_tokens, c.seed],
        "quant": ["int4-sym-group", c.int4_group_size, "clip-search"],
        "projector": [Projector.describe(info.hidden_size, hidden_size, target_rms), c.seed],
    }
    return hashlib.sha256(msgspec.json.encode(parts)).hexdigest()


class EncoderPipeline:
    """Builds the tower and projector once; `encode_batch` is safe to call from one thread at a time."""

    def __init__(self, config: EncoderConfig, hidden_size: int, target_rms: float | None = None) -> None:
        self.config = config
        self.hidden_size = hidden_size
        self.target_rms = target_rms
        self.device, self.dtype = resolve_device(config)
        t0 = time.perf_counter()
        tower, info = build_tower(config.tower, config.feature_layer, config.seed)
        self.spec = info.spec
        self.tower = tower.to(self.device, self.dtype)
        self.projector = Projector(tower.hidden_size, hidden_size, config.seed, target_rms).to(self.device)
        self.projector.eval().requires_grad_(False)
        self._forward = self.tower
        if config.compile and self.device.type == "cuda":
            self._forward = torch.compile(self.tower, mode="reduce-overhead", dynamic=False)
        self._nvjpeg = self.device.type == "cuda" and torchvision_jpeg_available()
        self._decoders = ThreadPoolExecutor(config.decode_threads, thread_name_prefix="vg-decode")
        self.fingerprint = encoder_fingerprint(config, hidden_size, target_rms)
        log.info(
            "encoder.built", tower=config.tower, device=str(self.device), dtype=str(self.dtype),
            layers_run=tower.num_layers_run, pruning=config.pruning, fingerprint=self.fingerprint[:16],
            build_s=round(time.perf_counter() - t0, 2),
        )

    @property
    def tokens_total(self) -> int:
        return self.spec.num_patches

    def close(self) -> None:
        self._decoders.shutdown(wait=False, cancel_futures=True)

    def warmup(self) -> None:
        """One throwaway encode so first real requests do not pay for lazy initialization."""
        import io

        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB", (self.spec.image_size + 13, self.spec.image_size), (120, 80, 200)).save(buf, "PNG")
        for result in self.encode_batch([buf.getvalue()]):
            if isinstance(result, ImageError):
                raise RuntimeError(f"warm-up encode failed: {result.message}")  # noqa: TRY004

    # -- stages -------------------------------------------------------------------------------

    def _decode_one(self, data: bytes) -> tuple[torch.Tensor | ImageError, float]:
        t0 = time.perf_counter()
        c = self.config
        try:
            arr = decode_image(data, c.max_image_bytes, c.max_pixels, min_side=self.spec.image_size)
            result: torch.Tensor | ImageError = torch.from_numpy(arr)
        except ImageError as exc:
            result = exc
        return result, (time.perf_counter() - t0) * 1e3

    def _decode(self, datas: list[bytes]) -> tuple[list[torch.Tensor | ImageError], list[float]]:
        if self._nvjpeg:
            t0 = time.perf_counter()
            c = self.config
            images = decode_jpeg_cuda(datas, c.max_image_bytes, c.max_pixels, self.device)
            self._sync()
            ms = (time.perf_counter() - t0) * 1e3 / max(len(datas), 1)
            return images, [ms] * len(datas)
        if len(datas) == 1:
            results = [self._decode_one(datas[0])]
        else:
            results = list(self._decoders.map(self._decode_one, datas))
        return [r[0] for r in results], [r[1] for r in results]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _run_tower(self, patches: torch.Tensor) -> TowerOutput:
        """patches [B, N, 3*P*P] -> TowerOutput, in fixed-shape pieces (see the module doc)."""
        b = patches.shape[0]
        if self.device.type == "cpu":
            if b == 1:
                return self._forward(patches)
            outs = [self._forward(patches[i : i + 1]) for i in range(b)]
            return TowerOutput(*(torch.cat(parts) for parts in zip(*outs)))
        outs = []
        m = self.config.max_batch
        for start in range(0, b, m):
            chunk = patches[start : start + m]
            if chunk.shape[0] < m:
                chunk = torch.cat([chunk, chunk[:1].expand(m - chunk.shape[0], -1, -1)])
            outs.append(TowerOutput(*(t.clone() for t in self._forward(chunk))))
        return TowerOutput(*(torch.cat(parts)[:b] for parts in zip(*outs)))

    # -- the batch ----------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_batch(self, datas: list[bytes]) -> list[EncodedImage | ImageError]:
        """Encode a batch; each slot holds the image's EncodedImage or its ImageError."""
        digests = [hashlib.sha256(d).hexdigest() for d in datas]
        images, decode_ms = self._decode(datas)
        ok = [i for i, im in enumerate(images) if not isinstance(im, ImageError)]
        results: list[EncodedImage | ImageError] = [
            im if isinstance(im, ImageError) else None for im in images  # type: ignore[misc]
        ]
        if not ok:
            return results
        n = len(ok)
        timer = _StageTimer(self._sync)
        patches = preprocess_batch([images[i] for i in ok], self.spec, self.device, self.dtype)
        timer.lap("preprocess")
        out = self._run_tower(patches)
        timer.lap("vision")
        seeds = [int(digests[i][:15], 16) ^ self.config.seed for i in ok]
        pruned = prune(out.features, out.saliency, out.keys, self.config, seeds)
        timer.lap("prune")
        counts = [p.tokens.shape[0] for p in pruned]
        embeds = [self.projector(p.tokens) for p in pruned]  # each [K, hidden]
        timer.lap("project")
        payloads = [
            quantize_tokens(e, p.positions, self.tokens_total, self.config.int4_group_size, p.n_contextual)
            for e, p in zip(embeds, pruned)
        ]
        timer.lap("quantize")
        stage_ms = {k: v / n for k, v in timer.ms.items()}
        for j, i in enumerate(ok):
            timings = {"decode": decode_ms[i], **stage_ms, "batch_size": float(n)}
            results[i] = EncodedImage(
                digest=digests[i],
                fingerprint=self.fingerprint,
                tokens_kept=counts[j],
                tokens_total=self.tokens_total,
                hidden_size=self.hidden_size,
                payload=payloads[j],
                timings_ms=timings,
            )
        return results


class _StageTimer:
    __slots__ = ("_sync", "_t", "ms")

    def __init__(self, sync) -> None:
        self._sync = sync
        self._t = time.perf_counter()
        self.ms: dict[str, float] = {}

    def lap(self, stage: str) -> None:
        self._sync()
        now = time.perf_counter()
        self.ms[stage] = (now - self._t) * 1e3
        self._t = now
