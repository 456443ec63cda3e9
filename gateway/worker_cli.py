"""`visiongate worker`: an encoder worker process serving gateways whose `encoder` setting is
`redis` (VISIONGATE_ENCODER=redis).

Flags that shape the tokens (tower, pruning, visual-token form, hidden size, target RMS) must
match the gateway's; with `--model-path` naming a VLM checkpoint (LLaVA, SmolVLM / Idefics3,
Qwen2.5-VL) the checkpoint's own vision tower and projector encode, and `--vision-tower`,
`--hidden-size` and `--target-rms` are ignored;
a worker started with others refuses the gateway's jobs into the dead-letter stream, naming the
value that differs. Defaults match the embedded default model (SmolLM2-135M-Instruct). Flags
also read `VISIONGATE_<NAME>` where the gateway has the same setting.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

__all__ = ("DEFAULT_HIDDEN_SIZE", "DEFAULT_TARGET_RMS", "register", "worker_config")

# The embedded SmolLM2-135M-Instruct: its hidden size, and the RMS of its token-embedding rows
# as the local engine measures it (float32 on the CPU); visual tokens are scaled to that RMS.
DEFAULT_HIDDEN_SIZE = 576
DEFAULT_TARGET_RMS = 0.13557929

# test hook: set to 1 and the worker SIGKILLs itself right after reading its first job
TEST_DIE_AFTER_READ_ENV = "VISIONGATE_TEST_WORKER_DIE_AFTER_READ"


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"VISIONGATE_{name.upper()}") or default


def _rms(value: str) -> float | None:
    if value.strip().lower() in ("none", ""):
        return None
    return float(value)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="run an encoder worker consuming encode jobs from Redis",
        description="Consume image-encoding jobs from the Redis stream vg:encode:jobs (consumer "
        "group 'encoders'), write the visual tokens to the vision cache and notify the waiting "
        "gateway. Run one per GPU (or a few per CPU host); jobs of a worker that dies are "
        "reclaimed by the others. Stops on SIGTERM/SIGINT after the batch in hand.",
    )
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
    p.set_defaults(func=cmd_worker)


def worker_config(args: argparse.Namespace):
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


def cmd_worker(args: argparse.Namespace) -> int:
    if not args.redis_url:
        print(
            "visiongate worker: --redis-url (or VISIONGATE_REDIS_URL) is required", file=sys.stderr
        )
        return 2
    try:
        config = worker_config(args)
    except ValueError as exc:
        print(f"visiongate worker: configuration error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(args, config))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("visiongate")
    except PackageNotFoundError:
        return "0.0.0"


async def _serve(args: argparse.Namespace, config) -> int:
    from redis.exceptions import RedisError

    from encoder_worker.pipeline import EncoderPipeline
    from encoder_worker.worker import EncoderWorker
    from gateway.telemetry import setup_telemetry

    env = dict(os.environ)
    env["OTEL_SERVICE_NAME"] = env.get("OTEL_SERVICE_NAME") or "visiongate-encoder"
    telemetry = setup_telemetry(_version(), log_level=args.log_level, env=env, set_global=True)

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
        telemetry=telemetry,
        test_die_after_read=os.environ.get(TEST_DIE_AFTER_READ_ENV) == "1",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            await worker.start()
        except (RedisError, OSError) as exc:
            print(
                f"visiongate worker: cannot use Redis at {args.redis_url}: {exc}", file=sys.stderr
            )
            return 1
        await worker.run_until(stop)
    finally:
        await worker.aclose()
        pipeline.close()
        with contextlib.suppress(Exception):
            telemetry.shutdown()
    return 0
