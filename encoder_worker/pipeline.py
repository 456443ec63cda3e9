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

When `config.tower` is a real VLM checkpoint (`config.family`), the tower and projector are
that checkpoint's own (`encoder_worker.families`), run image by image since shapes vary
(tiles, dynamic resolution):

    decode -> family.encode (its own preprocessing, vision tower, projector; saliency)
    -> patch dropping per run (kept rows stay in order; "dynamic+merge" acts as "dynamic":
       merged rows have no place in the checkpoint's prompt layout)
    -> family.layout(kept per run) with the kept rows' M-RoPE columns
    -> INT4, bf16 or fp32 payload (`visual_tokens`) -> EncodedImage with `layout`

With pruning "none" and fp32 tokens (exact mode) the rows are the checkpoint's
`get_image_features` as they are, and images are decoded at full resolution.

It stays one module: `EncoderPipeline` is one path from bytes to tokens
whose steps share the fixed shapes above, and `encoder_fingerprint` beside it must name exactly
what that path runs; the steps themselves already live in their own modules (`decode`,
`patch_rows`, `tower`, `pruning`, `projector`, `payload`, `families`).
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
from encoder_worker.patch_rows import preprocess_batch
from encoder_worker.payload import float_tokens, quantize_tokens
from encoder_worker.projector import Projector
from encoder_worker.pruning import prune
from encoder_worker.tower import TowerOutput, build_tower, describe_tower
from encoder_worker.types import EncodedImage, ImageError

__all__ = (
    "EncoderPipeline",
    "budget_config",
    "encoder_fingerprint",
    "resolve_device",
    "vlm_description",
)

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
    a CPU worker share cache entries (their tokens differ only in rounding).

    For a VLM checkpoint the projector is the checkpoint's, so neither `hidden_size` nor
    `target_rms` enters: gateway and workers agree from the checkpoint alone."""
    c = config
    if c.family is not None:
        parts = {
            "format": FORMAT_VERSION,
            "vlm": vlm_description(c.tower),
            "pruning": [
                _family_pruning(c.pruning),
                c.keep_ratio,
                c.min_keep_ratio,
                c.max_keep_ratio,
                c.saliency_mass,
                c.seed,
            ],
            "visual_tokens": c.visual_tokens,
            "quant": ["int4-sym-group", c.int4_group_size, "clip-search"]
            if c.visual_tokens == "int4"
            else [],
        }
        return hashlib.sha256(msgspec.json.encode(parts)).hexdigest()
    info = describe_tower(c.tower, c.seed)
    parts = {
        "format": FORMAT_VERSION,
        "weights": info.weights_id,
        "feature_layer": c.feature_layer,
        "preprocess": msgspec.to_builtins(info.spec),
        "pruning": [
            c.pruning,
            c.keep_ratio,
            c.min_keep_ratio,
            c.max_keep_ratio,
            c.saliency_mass,
            c.merge_tokens,
            c.seed,
        ],
        "quant": ["int4-sym-group", c.int4_group_size, "clip-search"],
        "projector": [Projector.describe(info.hidden_size, hidden_size, target_rms), c.seed],
    }
    if c.visual_tokens != "int4":  # absent for int4: the default's fingerprint predates the choice
        parts["quant"] = [c.visual_tokens]
    return hashlib.sha256(msgspec.json.encode(parts)).hexdigest()


def budget_config(config: EncoderConfig, cap: float | None) -> EncoderConfig:
    """`config` with its keep ratios capped at `cap` (a smaller visual-token budget, which is
    other content: its fingerprint differs). `config` itself when `cap` is None, nothing is
    pruned, or no ratio is above `cap`."""
    if cap is None or config.pruning == "none":
        return config
    capped = {
        name: min(getattr(config, name), cap)
        for name in ("keep_ratio", "min_keep_ratio", "max_keep_ratio")
    }
    if all(getattr(config, name) == value for name, value in capped.items()):
        return config
    return msgspec.structs.replace(config, **capped)


def _family_pruning(mode: str) -> str:
    # merged (contextual) rows have no place in a real checkpoint's prompt layout
    return "dynamic" if mode == "dynamic+merge" else mode


_DESCRIPTIONS: dict[str, dict] = {}


def vlm_description(checkpoint_dir: str) -> dict:
    """A VLM checkpoint's identity, from its files alone (no model built): family, weights id
    (`encoder_worker.checkpoint.checkpoint_id`) and, where the family module offers
    `describe_checkpoint`, what its `Family.describe()` reports."""
    import importlib

    from encoder_worker.checkpoint import checkpoint_id
    from encoder_worker.families.family import FAMILIES, read_config

    weights = checkpoint_id(checkpoint_dir)
    if weights not in _DESCRIPTIONS:
        module = FAMILIES[read_config(checkpoint_dir).get("model_type", "")]
        described = getattr(
            importlib.import_module(f"encoder_worker.families.{module}"),
            "describe_checkpoint",
            None,
        )
        _DESCRIPTIONS[weights] = {
            "family": module,
            "weights": weights,
            "describe": described(checkpoint_dir) if described is not None else None,
        }
    return _DESCRIPTIONS[weights]


class EncoderPipeline:
    """Builds the tower and projector once.

    `encode_batch` is safe to call from one thread at a time.
    """

    def __init__(
        self, config: EncoderConfig, hidden_size: int | None, target_rms: float | None = None
    ) -> None:
        self.config = config
        self.device, self.dtype = resolve_device(config)
        self.family = None
        if config.family is not None:
            self._build_family(hidden_size, target_rms)
            return
        if hidden_size is None:
            raise ValueError("hidden_size is required unless the tower is a VLM checkpoint")
        self.hidden_size = hidden_size
        self.target_rms = target_rms
        t0 = time.perf_counter()
        tower, info = build_tower(config.tower, config.feature_layer, config.seed)
        self.spec = info.spec
        self.tower = tower.to(self.device, self.dtype)
        self.projector = Projector(tower.hidden_size, hidden_size, config.seed, target_rms).to(
            self.device
        )
        self.projector.eval().requires_grad_(False)
        self._forward = self.tower
        if config.compile and self.device.type == "cuda":
            self._forward = torch.compile(self.tower, mode="reduce-overhead", dynamic=False)
        self._nvjpeg = self.device.type == "cuda" and torchvision_jpeg_available()
        self._decoders = ThreadPoolExecutor(config.decode_threads, thread_name_prefix="vg-decode")
        self.fingerprint = encoder_fingerprint(config, hidden_size, target_rms)
        log.info(
            "encoder.built",
            tower=config.tower,
            device=str(self.device),
            dtype=str(self.dtype),
            layers_run=tower.num_layers_run,
            pruning=config.pruning,
            fingerprint=self.fingerprint[:16],
            build_s=round(time.perf_counter() - t0, 2),
        )

    def _build_family(self, hidden_size: int | None, target_rms: float | None) -> None:
        from encoder_worker.families import load_family

        config = self.config
        t0 = time.perf_counter()
        self.family = load_family(config.tower, self.device, self.dtype)
        self.hidden_size = self.family.lm_hidden_size
        if hidden_size and hidden_size != self.hidden_size:
            raise ValueError(
                f"{config.tower}: its visual tokens are {self.hidden_size} wide but the language "
                f"model expects {hidden_size}"
            )
        if target_rms is not None:
            log.info("encoder.target_rms_ignored", reason="a VLM checkpoint has its own projector")
        self.target_rms = None
        self.spec = None
        self._nvjpeg = False  # the checkpoint's processor reads decoded pixels as they are
        self._decoders = ThreadPoolExecutor(config.decode_threads, thread_name_prefix="vg-decode")
        self.fingerprint = encoder_fingerprint(config, self.hidden_size, None)
        if config.pruning == "dynamic+merge":
            log.info(
                "encoder.pruning_fallback",
                requested="dynamic+merge",
                used="dynamic",
                reason="merged rows have no place in the checkpoint's prompt layout",
            )
        log.info(
            "encoder.built",
            tower=config.tower,
            family=self.family.name,
            device=str(self.device),
            dtype=str(self.dtype),
            pruning=_family_pruning(config.pruning),
            visual_tokens=config.visual_tokens,
            lm_hidden=self.hidden_size,
            fingerprint=self.fingerprint[:16],
            build_s=round(time.perf_counter() - t0, 2),
        )

    @property
    def batch_limit(self) -> int:
        """Images worth gathering into one batch: `max_batch` on an accelerator, `cpu_batch`
        (default 1) on a CPU, where the tower runs image by image anyway, so a bigger batch
        only makes an image that arrives while it runs wait for all of it."""
        c = self.config
        return min(c.cpu_batch, c.max_batch) if self.device.type == "cpu" else c.max_batch

    @property
    def tokens_total(self) -> int:
        """Patch tokens per image before dropping (0: it varies per image, VLM checkpoints)."""
        return self.spec.num_patches if self.spec is not None else 0

    @property
    def _min_side(self) -> int:
        if self.family is None:
            return self.spec.image_size
        # exact mode decodes at full resolution, as transformers' own pipeline would
        return 0 if self.config.exact else int(getattr(self.family, "min_decode_side", 0))

    def close(self) -> None:
        self._decoders.shutdown(wait=False, cancel_futures=True)

    def warmup(self) -> None:
        """One throwaway encode so first real requests do not pay for lazy initialization."""
        import io

        from PIL import Image

        side = max(self._min_side, 64)
        buf = io.BytesIO()
        Image.new("RGB", (side + 13, side), (120, 80, 200)).save(buf, "PNG")
        for result in self.encode_batch([buf.getvalue()]):
            if isinstance(result, ImageError):
                raise RuntimeError(f"warm-up encode failed: {result.message}")

    # -- stages -------------------------------------------------------------------------------

    def _decode_one(self, data: bytes) -> tuple[torch.Tensor | ImageError, float]:
        t0 = time.perf_counter()
        c = self.config
        try:
            arr = decode_image(data, c.max_image_bytes, c.max_pixels, min_side=self._min_side)
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
            return TowerOutput(*(torch.cat(parts) for parts in zip(*outs, strict=False)))
        outs = []
        m = self.config.max_batch
        for start in range(0, b, m):
            chunk = patches[start : start + m]
            if chunk.shape[0] < m:
                chunk = torch.cat([chunk, chunk[:1].expand(m - chunk.shape[0], -1, -1)])
            outs.append(TowerOutput(*(t.clone() for t in self._forward(chunk))))
        return TowerOutput(*(torch.cat(parts)[:b] for parts in zip(*outs, strict=False)))

    # -- the batch ----------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_batch(
        self, datas: list[bytes], max_keep_ratio: float | None = None
    ) -> list[EncodedImage | ImageError]:
        """Encode a batch; each slot holds the image's EncodedImage or its ImageError.
        `max_keep_ratio` caps the keep ratios (`budget_config`); the tokens then carry that
        budget's fingerprint."""
        config = budget_config(self.config, max_keep_ratio)
        fingerprint = (
            self.fingerprint
            if config is self.config
            else encoder_fingerprint(config, self.hidden_size, self.target_rms)
        )
        digests = [hashlib.sha256(d).hexdigest() for d in datas]
        images, decode_ms = self._decode(datas)
        ok = [i for i, im in enumerate(images) if not isinstance(im, ImageError)]
        results: list[EncodedImage | ImageError] = [
            im if isinstance(im, ImageError) else None
            for im in images  # type: ignore[misc]
        ]
        if not ok:
            return results
        if self.family is not None:
            for i in ok:
                results[i] = self._encode_family(
                    images[i], digests[i], decode_ms[i], len(ok), config, fingerprint
                )
            return results
        n = len(ok)
        timer = _StageTimer(self._sync)
        patches = preprocess_batch([images[i] for i in ok], self.spec, self.device, self.dtype)
        timer.lap("preprocess")
        out = self._run_tower(patches)
        timer.lap("vision")
        seeds = [int(digests[i][:15], 16) ^ self.config.seed for i in ok]
        pruned = prune(out.features, out.saliency, out.keys, config, seeds)
        timer.lap("prune")
        counts = [p.tokens.shape[0] for p in pruned]
        embeds = [self.projector(p.tokens) for p in pruned]  # each [K, hidden]
        timer.lap("project")
        if self.config.visual_tokens == "int4":
            payloads = [
                quantize_tokens(
                    e, p.positions, self.tokens_total, self.config.int4_group_size, p.n_contextual
                )
                for e, p in zip(embeds, pruned, strict=False)
            ]
        else:
            payloads = [
                float_tokens(
                    e, p.positions, self.tokens_total, self.config.visual_tokens, p.n_contextual
                )
                for e, p in zip(embeds, pruned, strict=False)
            ]
        timer.lap("quantize")
        stage_ms = {k: v / n for k, v in timer.ms.items()}
        for j, i in enumerate(ok):
            timings = {"decode": decode_ms[i], **stage_ms, "batch_size": float(n)}
            results[i] = EncodedImage(
                digest=digests[i],
                fingerprint=fingerprint,
                tokens_kept=counts[j],
                tokens_total=self.tokens_total,
                hidden_size=self.hidden_size,
                payload=payloads[j],
                timings_ms=timings,
            )
        return results

    def _encode_family(
        self,
        image: torch.Tensor,
        digest: str,
        decode_ms: float,
        batch_size: int,
        config: EncoderConfig | None = None,
        fingerprint: str | None = None,
    ) -> EncodedImage:
        """One image through the checkpoint's own encoder (see the module doc)."""
        family = self.family
        timer = _StageTimer(self._sync)
        out = family.encode(image.numpy())
        n = int(out.embeds.shape[0])
        if (
            out.embeds.shape != (n, self.hidden_size)
            or sum(out.runs) != n
            or out.saliency.shape != (n,)
        ):
            raise RuntimeError(
                f"{family.name} family returned embeds {tuple(out.embeds.shape)}, saliency "
                f"{tuple(out.saliency.shape)}, runs summing to {sum(out.runs)}"
            )
        timer.lap("vision")
        rows, positions, kept = self._drop(
            out, int(digest[:15], 16) ^ self.config.seed, config or self.config
        )
        layout = family.layout(kept, out)
        if out.mrope is not None:  # the kept rows keep their original (t, h, w) positions
            columns = out.mrope[:, positions.to(out.mrope.device)].T.reshape(-1)  # [K*3]
            layout = msgspec.structs.replace(
                layout,
                mrope=tuple(int(v) for v in columns.tolist()),
                mrope_advance=layout.mrope_advance or int(out.mrope_advance),
            )
        if layout.rows != rows.shape[0]:
            raise RuntimeError(f"layout places {layout.rows} rows, {rows.shape[0]} were kept")
        timer.lap("prune")
        c = self.config
        if c.visual_tokens == "int4":
            payload = quantize_tokens(rows, positions, n, c.int4_group_size)
        else:
            payload = float_tokens(rows, positions, n, c.visual_tokens)
        timer.lap("quantize")
        timings = {
            "decode": decode_ms,
            "preprocess": 0.0,
            **timer.ms,
            "project": 0.0,
            "batch_size": float(batch_size),
        }
        return EncodedImage(
            digest=digest,
            fingerprint=fingerprint or self.fingerprint,
            tokens_kept=int(rows.shape[0]),
            tokens_total=n,
            hidden_size=self.hidden_size,
            payload=payload,
            timings_ms=timings,
            layout=layout,
        )

    def _drop(
        self, out, seed: int, config: EncoderConfig
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Patch dropping per run -> (kept rows [K, D], their row indices [K], kept per run)."""
        mode = _family_pruning(config.pruning)
        n = int(out.embeds.shape[0])
        if mode == "none":
            return out.embeds, torch.arange(n), list(out.runs)
        cfg = msgspec.structs.replace(config, pruning=mode)
        rows, positions, kept = [], [], []
        start = 0
        for r, size in enumerate(out.runs):
            feats = out.embeds[start : start + size][None]  # [1, n_r, D]
            sal = out.saliency[start : start + size][None]  # [1, n_r]
            p = prune(feats, sal, feats, cfg, [seed + r])[0]
            rows.append(p.tokens)
            positions.append(p.positions.cpu() + start)
            kept.append(int(p.tokens.shape[0]))
            start += size
        return torch.cat(rows), torch.cat(positions), kept


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
