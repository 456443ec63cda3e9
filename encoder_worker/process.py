"""One encoder worker process: its flags, the `EncoderConfig` they make, and the run until
SIGTERM / SIGINT.

`python -m encoder_worker` and `visiongate worker` share these flags; the latter also exports
spans and metrics as the gateway's telemetry settings (`OTEL_*`) say. Flags that shape the
tokens (tower, pruning, visual-token form, hidden size, target RMS) must match the gateway's;
with `--model-path` naming a VLM checkpoint (LLaVA, SmolVLM / Idefics3, Qwen2.5-VL) the
checkpoint's own vision tower and projector encode, and `--vision-tower`, `--hidden-size` and
`--target-rms` are ignored. A worker started with others refuses the gateway's jobs into the
dead-letter stream, naming the value that differs. Defaults match the embedded default model
(SmolLM2-135M-Instruct). Flags also read `VISIONGATE_<NAME>` where the gateway has the same
setting.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import TYPE_CHECKING

from encoder_worker.storage import GROUP, JOBS_STREAM

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

    from encoder_worker.config import EncoderConfig
    from encoder_worker.worker import EncodeMetrics

__all__ = (
    "DEFAULT_HIDDEN_SIZE",
    "DEFAULT_TARGET_RMS",
    "DESCRIPTION",
    "add_worker_arguments",
    "checked_config",
    "serve",
    "worker_config",
)

# The embedded SmolLM2-135M-Instruct: its hidden size, and the RMS of its token-embedding rows
# as the local engine measures it (float32 on the CPU); visual tokens are scaled to that RMS.
DEFAULT_HIDDEN_SIZE = 576
DEFAULT_TARGET_RMS = 0.13557929

DESCRIPTION = (
    f"Consume image-encoding jobs from the Redis stream {JOBS_STREAM} (consumer group "
    f"'{GROUP}'), write the visual tokens to the vision cache and notify the waiting gateway. "
    "Run one per GPU (or a few per CPU host); jobs of a worker that dies are reclaimed by the "
    "others. Stops on SIGTERM/SIGINT after the batch in hand."
)


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"VISIONGATE_{name.upper()}") or default


def _rms(value: str) -> float | None:
    if value.strip().lower() in ("none", ""):
        return None
    return float(value)


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-url",
        default=_env("redis_url"),
        help="redis://host:port/db shared with the gateways (VISIONGATE_REDIS_URL)",
    )
    p.add_argument("--consumer", help="consumer name in the group (default: hostname-pid)")
    g = p.add_argument_group("encoder (must match the gateway's)")
    g.add_argument(
        "--model-path",
        default=_env("model_path"),
        help="the gateway's model checkpoint dir; a VLM checkpoint (LLaVA, SmolVLM/Idefics3, "
        "Qwen2.5-VL) is encoded with its own vision tower and projector (VISIONGATE_MODEL_PATH)",
    )
    g.add_argument(
        "--vision-tower",
        default=_env("vision_tower", "vit-b16-224"),
        help="vit-b16-224 | vit-l14-336 | local CLIP/SigLIP checkpoint dir",
    )
    g.add_argument(
        "--pruning",
        default=_env("pruning", "dynamic"),
        help="none | random | topk | dynamic | dynamic+merge",
    )
    g.add_argument(
        "--visual-tokens",
        default=_env("visual_tokens", "int4"),
        help="int4 | bf16 | fp32: stored form of the visual tokens (VISIONGATE_VISUAL_TOKENS)",
    )
    g.add_argument(
        "--hidden-size",
        type=int,
        default=DEFAULT_HIDDEN_SIZE,
        help=f"the language model's hidden size (default {DEFAULT_HIDDEN_SIZE})",
    )
    g.add_argument(
        "--target-rms",
        type=_rms,
        default=DEFAULT_TARGET_RMS,
        help="RMS of the language model's token embeddings, or 'none' "
        f"(default {DEFAULT_TARGET_RMS!r}: the embedded model's)",
    )
    g.add_argument("--device", default=_env("device", "auto"), help="auto | cpu | cuda | cuda:N")
    g.add_argument(
        "--max-image-bytes",
        type=int,
        default=_env("max_image_bytes", str(20 * 1024 * 1024)),
        help="larger images are refused as image_too_large (default 20 MiB)",
    )
    g.add_argument(
        "--max-pixels",
        type=int,
        default=_env("max_pixels", "40000000"),
        help="decoded size limit, checked from the header (default 40000000)",
    )
    q = p.add_argument_group("queue")
    q.add_argument(
        "--max-batch", type=int, default=8, help="jobs read and encoded together (default 8)"
    )
    q.add_argument(
        "--block-ms",
        type=int,
        default=1000,
        help="longest wait for new jobs per read; bounds shutdown latency (default 1000)",
    )
    q.add_argument(
        "--claim-idle-ms",
        type=int,
        default=30_000,
        help="reclaim jobs pending this long at another (dead) worker; a live worker keeps its "
        "batch claimed while it encodes (default 30000)",
    )
    q.add_argument(
        "--max-attempts",
        type=int,
        default=3,
        help="runs of one job before it goes to the dead-letter stream (default 3)",
    )
    q.add_argument(
        "--vision-cache-ttl-s",
        type=float,
        default=_env("vision_cache_ttl_s", "86400"),
        help="TTL of the tokens written to the vision cache (default 86400)",
    )
    p.add_argument(
        "--log-level", default=_env("log_level", "info"), help="debug | info | warning | error"
    )


def worker_config(args: argparse.Namespace) -> EncoderConfig:
    """The worker's EncoderConfig from its flags; ValueError names what is wrong.

    A VLM checkpoint under --model-path becomes the tower, and the synthetic projector's
    --hidden-size / --target-rms are cleared (the checkpoint brings its own projector)."""
    from encoder_worker.config import EncoderConfig, tower_family

    tower = args.vision_tower
    if args.model_path and not os.path.isdir(args.model_path):
        raise ValueError(f"--model-path {args.model_path!r} is not a directory")
    if args.model_path and tower_family(args.model_path) is not None:
        tower = args.model_path
        args.hidden_size, args.target_rms = None, None
    return EncoderConfig(
        tower=tower,
        pruning=args.pruning,
        visual_tokens=args.visual_tokens,
        device=args.device,
        max_batch=args.max_batch,
        max_image_bytes=args.max_image_bytes,
        max_pixels=args.max_pixels,
    )


def checked_config(args: argparse.Namespace, prog: str) -> EncoderConfig | None:
    """`worker_config`, after checking that a Redis URL is given; on a bad flag, says what is
    wrong on stderr and returns None (exit status 2)."""
    if not args.redis_url:
        print(f"{prog}: --redis-url (or VISIONGATE_REDIS_URL) is required", file=sys.stderr)
        return None
    try:
        return worker_config(args)
    except ValueError as exc:
        print(f"{prog}: configuration error: {exc}", file=sys.stderr)
        return None


async def serve(
    args: argparse.Namespace,
    config: EncoderConfig,
    *,
    prog: str,
    tracer: Tracer | None = None,
    metrics: EncodeMetrics | None = None,
) -> int:
    """Build and warm the pipeline, then serve jobs until SIGTERM / SIGINT; the exit status."""
    from redis.exceptions import RedisError

    from encoder_worker.pipeline import EncoderPipeline
    from encoder_worker.worker import EncoderWorker

    def build() -> EncoderPipeline:
        pipeline = EncoderPipeline(config, args.hidden_size, args.target_rms)
        pipeline.warmup()
        return pipeline

    pipeline = await asyncio.to_thread(build)
    worker = EncoderWorker(
        args.redis_url,
        pipeline,
        consumer=args.consumer,
        block_ms=args.block_ms,
        claim_idle_ms=args.claim_idle_ms,
        max_attempts=args.max_attempts,
        vision_ttl_s=args.vision_cache_ttl_s,
        tracer=tracer,
        metrics=metrics,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            await worker.start()
        except (RedisError, OSError) as exc:
            print(f"{prog}: cannot use Redis at {args.redis_url}: {exc}", file=sys.stderr)
            return 1
        await worker.run_until(stop)
    finally:
        await worker.aclose()
        pipeline.close()
    return 0
