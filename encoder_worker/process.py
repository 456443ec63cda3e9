"""One encoder worker process: its flags, the encoder it adopts from its gateways, and the run
until SIGTERM / SIGINT.

`python -m encoder_worker` and `visiongate worker` share these flags; the latter also exports
spans and metrics as the gateway's telemetry settings (`OTEL_*`) say.

The encoder is the gateway's. A gateway with `--encoder redis` publishes what it encodes with
(`jobs.EncoderSpec`: tower, pruning, visual-token form, image limits, its language model's
hidden size and embedding RMS in the dtype it runs, and the fingerprint they make) and points
its deployment at it (`storage.current_spec_key`). The worker waits for that, logging as it
waits, builds the same encoder, checks that it reproduces the gateway's fingerprint, and only
then joins the job stream. Flags that shape the tokens (`--model-path`, `--vision-tower`,
`--pruning`, `--visual-tokens`, `--hidden-size`, `--target-rms`, and their `VISIONGATE_*`
variables) are optional: one given is an assertion, and a value the gateway does not share
stops the worker at startup (exit status 2) with the flag and both values named. A path flag
(`--model-path`, a local `--vision-tower`) may name the same checkpoint at another path: it
agrees when the fingerprints do.

When a gateway of the deployment starts with another configuration, the workers follow it:
each builds the new encoder between batches and serves it from then on (no restart needed);
one whose explicit flags contradict the new configuration exits with status 2 and the same
kind of message, so its supervisor's restarts make the conflict plain. Device, dtype, batching
and the image limits given as flags stay the worker's own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

import structlog

from encoder_worker.redis_conn import REDIS_FAILURES, async_client, redacted
from encoder_worker.storage import (
    DEFAULT_DEPLOYMENT,
    GROUP,
    JOBS_STREAM,
    check_deployment,
    current_spec_key,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer
    from redis.asyncio import Redis, RedisCluster

    from encoder_worker.config import EncoderConfig
    from encoder_worker.jobs import EncoderSpec
    from encoder_worker.pipeline import EncoderPipeline
    from encoder_worker.worker import EncodeMetrics

__all__ = (
    "DEFAULT_HIDDEN_SIZE",
    "DEFAULT_TARGET_RMS",
    "DESCRIPTION",
    "SpecAdopter",
    "add_worker_arguments",
    "checked_config",
    "serve",
    "wait_for_spec",
    "worker_config",
)

log = structlog.get_logger("encoder_worker.process")

# The embedded SmolLM2-135M-Instruct: its hidden size, and the RMS of its token-embedding rows
# as the local engine measures it in float32 (bfloat16 weights measure 0.13557793). Workers take
# the live values from their gateway; these serve tools and tests that build an encoder alone.
DEFAULT_HIDDEN_SIZE = 576
DEFAULT_TARGET_RMS = 0.13557929

DESCRIPTION = (
    f"Consume image-encoding jobs from the Redis stream {JOBS_STREAM} (consumer group "
    f"'{GROUP}'), write the visual tokens to the vision cache and notify the waiting gateway. "
    "The encoder configuration is the one the deployment's gateways publish in Redis: the "
    "worker waits for it, adopts it and follows it when it changes. Run one per GPU (or a few "
    "per CPU host); jobs of a worker that dies are reclaimed by the others. Stops on "
    "SIGTERM/SIGINT after the batch in hand."
)

# flags that shape the tokens: (argparse dest, flag, environment variable)
_PINNABLE = (
    ("model_path", "--model-path", "VISIONGATE_MODEL_PATH"),
    ("vision_tower", "--vision-tower", "VISIONGATE_VISION_TOWER"),
    ("pruning", "--pruning", "VISIONGATE_PRUNING"),
    ("visual_tokens", "--visual-tokens", "VISIONGATE_VISUAL_TOKENS"),
    ("hidden_size", "--hidden-size", None),
    ("target_rms", "--target-rms", None),
)


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"VISIONGATE_{name.upper()}") or default


def _rms_text(value: str) -> str:
    """--target-rms as given: 'none' (no rescaling) or a float's text (checked here)."""
    if value.strip().lower() in ("none", ""):
        return "none"
    return repr(float(value))


def _deployment(value: str) -> str:
    try:
        return check_deployment(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-url",
        default=_env("redis_url"),
        help="redis://host:port/db or redis+cluster://host:port[,...] shared with the gateways "
        "(VISIONGATE_REDIS_URL)",
    )
    p.add_argument(
        "--deployment",
        type=_deployment,
        default=_env("encoder_deployment", DEFAULT_DEPLOYMENT),
        help="the gateways this worker serves: their job stream and encoder configuration "
        f"(default {DEFAULT_DEPLOYMENT!r}; VISIONGATE_ENCODER_DEPLOYMENT)",
    )
    p.add_argument("--consumer", help="consumer name in the group (default: hostname-pid)")
    g = p.add_argument_group(
        "encoder (taken from the gateway; give one only to insist on a value, and the worker "
        "stops if the gateway's differs)"
    )
    g.add_argument(
        "--model-path",
        default=_env("model_path"),
        help="a VLM checkpoint dir (LLaVA, SmolVLM/Idefics3, Qwen2.5-VL): its own vision tower "
        "and projector encode; the gateway's checkpoint, possibly at another path here "
        "(VISIONGATE_MODEL_PATH)",
    )
    g.add_argument(
        "--vision-tower",
        default=_env("vision_tower"),
        help="vit-b16-224 | vit-l14-336 | local CLIP/SigLIP checkpoint dir",
    )
    g.add_argument(
        "--pruning",
        default=_env("pruning"),
        help="none | random | topk | dynamic | dynamic+merge",
    )
    g.add_argument(
        "--visual-tokens",
        default=_env("visual_tokens"),
        help="int4 | bf16 | fp32: stored form of the visual tokens (VISIONGATE_VISUAL_TOKENS)",
    )
    g.add_argument("--hidden-size", type=int, help="the language model's hidden size")
    g.add_argument(
        "--target-rms",
        type=_rms_text,
        help="RMS of the language model's token embeddings in the dtype the gateway runs, or "
        "'none'",
    )
    g.add_argument("--device", default=_env("device", "auto"), help="auto | cpu | cuda | cuda:N")
    g.add_argument(
        "--max-image-bytes",
        type=int,
        default=_env("max_image_bytes"),
        help="larger images are refused as image_too_large (default: the gateway's)",
    )
    g.add_argument(
        "--max-pixels",
        type=int,
        default=_env("max_pixels"),
        help="decoded size limit, checked from the header (default: the gateway's)",
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
    """The worker's EncoderConfig from its flags alone (the encoder defaults where a flag is
    not given); ValueError names what is wrong. The gateway's spec later replaces the fields it
    publishes (`SpecAdopter`); device and batching are the worker's.

    A VLM checkpoint under --model-path becomes the tower, and the synthetic projector's
    --hidden-size / --target-rms are cleared (the checkpoint brings its own projector)."""
    from encoder_worker.config import EncoderConfig, tower_family

    tower = args.vision_tower
    if args.model_path and not os.path.isdir(args.model_path):
        raise ValueError(f"--model-path {args.model_path!r} is not a directory")
    if args.model_path and tower_family(args.model_path) is not None:
        tower = args.model_path
        args.hidden_size, args.target_rms = None, None
    given = {
        "tower": tower,
        "pruning": args.pruning,
        "visual_tokens": args.visual_tokens,
        "max_image_bytes": args.max_image_bytes,
        "max_pixels": args.max_pixels,
    }
    return EncoderConfig(
        device=args.device,
        max_batch=args.max_batch,
        **{k: v for k, v in given.items() if v is not None},
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


class SpecAdopter:
    """Turns a gateway's `EncoderSpec` into this worker's pipeline: the spec's fields, the
    worker's own device and batching, and its explicit token flags checked, never silently
    overridden. `build` is also what the running worker calls when the spec changes."""

    def __init__(self, args: argparse.Namespace, local: EncoderConfig) -> None:
        from encoder_worker.config import tower_family

        self.local = local
        self.deployment = args.deployment
        # explicit token flags: dest -> (flag as the user knows it, value)
        self.pins: dict[str, tuple[str, Any]] = {}
        for dest, flag, env in _PINNABLE:
            value = getattr(args, dest, None)
            if value is None:
                continue
            if dest == "model_path" and tower_family(value) is None:
                continue  # a text-only model: the gateway's concern, not the encoder's
            self.pins[dest] = (f"{flag} / {env}" if env and os.environ.get(env) else flag, value)
        # image limits given as flags are the worker's own (they do not change the tokens)
        self.limits = {
            name: getattr(args, name)
            for name in ("max_image_bytes", "max_pixels")
            if getattr(args, name, None) is not None
        }

    def _pinned(self, dest: str) -> Any:
        return self.pins[dest][1] if dest in self.pins else None

    def resolve(self, spec: EncoderSpec) -> tuple[EncoderConfig, int | None, float | None]:
        """The EncoderConfig, hidden size and target RMS that reproduce `spec` here;
        `ConfigConflict` naming the flags (with both values) when they cannot."""
        from encoder_worker.config import SYNTHETIC_TOWERS
        from encoder_worker.deployment_follower import ConfigConflict
        from encoder_worker.jobs import spec_config
        from encoder_worker.pipeline import encoder_fingerprint

        where = f"deployment {self.deployment!r}, gateway encoder {spec.fingerprint[:16]}"
        overrides: dict[str, Any] = dict(self.limits)
        tower = self._pinned("model_path") or self._pinned("vision_tower")
        if tower is not None:
            overrides["tower"] = tower
        for dest in ("pruning", "visual_tokens"):
            if dest in self.pins:
                overrides[dest] = self._pinned(dest)
        try:
            config = spec_config(spec, self.local, **overrides)
        except (ValueError, TypeError) as exc:
            wanted = overrides.get("tower", spec.encoder.tower)
            hint = (
                "; make the gateway's checkpoint available here at the same path, or name it "
                "with --model-path / --vision-tower"
                if wanted not in SYNTHETIC_TOWERS and not os.path.isdir(wanted)
                else ""
            )
            raise ConfigConflict(
                f"cannot adopt the gateway's encoder ({where}): {exc}{hint}"
            ) from None
        hidden, rms = spec.hidden_size, spec.target_rms
        if config.family is None:
            if "hidden_size" in self.pins:
                hidden = self._pinned("hidden_size")
            if "target_rms" in self.pins:
                text = self._pinned("target_rms")
                rms = None if text == "none" else float(text)
        try:
            fingerprint = encoder_fingerprint(config, hidden, rms)
        except ValueError as exc:
            raise ConfigConflict(f"cannot adopt the gateway's encoder ({where}): {exc}") from None
        if fingerprint == spec.fingerprint:
            return config, hidden, rms
        theirs = {
            "model_path": spec.encoder.tower,
            "vision_tower": spec.encoder.tower,
            "pruning": spec.encoder.pruning,
            "visual_tokens": spec.encoder.visual_tokens,
            "hidden_size": spec.hidden_size,
            "target_rms": spec.target_rms,
        }
        ours = {**{d: v for d, (_, v) in self.pins.items()}, "hidden_size": hidden}
        ours["target_rms"] = rms
        differing = [
            f"{self.pins[d][0]} {_show(ours[d])} differs from the gateway's {_show(theirs[d])}"
            for d in self.pins
            if ours[d] != theirs[d]
        ]
        if differing:
            flags = " and ".join(self.pins[d][0] for d in self.pins if ours[d] != theirs[d])
            raise ConfigConflict(
                f"{'; '.join(differing)} ({where}): start the worker without {flags} to take "
                "the gateway's values"
            )
        raise ConfigConflict(
            f"this worker computes encoder {fingerprint[:16]} for the gateway's configuration "
            f"({where}): the two run different visiongate releases, or see different files at "
            f"{config.tower}"
        )

    def build(self, spec: EncoderSpec) -> EncoderPipeline:
        """A warmed-up pipeline that encodes exactly as the gateway's spec says (blocking)."""
        from encoder_worker.deployment_follower import ConfigConflict
        from encoder_worker.pipeline import EncoderPipeline

        config, hidden, rms = self.resolve(spec)
        try:
            pipeline = EncoderPipeline(config, hidden, rms)
        except ValueError as exc:  # e.g. a VLM checkpoint narrower than the gateway's LM
            raise ConfigConflict(f"cannot build the gateway's encoder: {exc}") from None
        if pipeline.fingerprint != spec.fingerprint:
            pipeline.close()
            raise ConfigConflict(
                f"the encoder built here has fingerprint {pipeline.fingerprint[:16]}, the "
                f"gateway's is {spec.fingerprint[:16]}"
            )
        pipeline.warmup()
        log.info(
            "worker.adopted",
            deployment=self.deployment,
            fingerprint=spec.fingerprint[:16],
            tower=config.tower,
            pruning=config.pruning,
            visual_tokens=config.visual_tokens,
            hidden_size=pipeline.hidden_size,
            target_rms=pipeline.target_rms,
            pinned=sorted(self.pins),
        )
        return pipeline


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


async def wait_for_spec(
    client: Redis | RedisCluster,
    deployment: str,
    stop: asyncio.Event,
    *,
    poll_s: float = 0.5,
    report_s: float = 10.0,
) -> EncoderSpec | None:
    """The deployment's current encoder spec once a gateway has published one, or None if
    `stop` is set first. Says every `report_s` that it is still waiting, and for what. Redis
    errors while waiting are logged and retried; ValueError if the spec does not decode."""
    from encoder_worker.deployment_follower import read_current_spec

    started = time.monotonic()
    next_report = started
    while not stop.is_set():
        try:
            spec = await read_current_spec(client, deployment)
        except REDIS_FAILURES as exc:
            log.warning("worker.redis_error", error=repr(exc), retry_in_s=poll_s)
            spec = None
        if spec is not None:
            return spec
        if time.monotonic() >= next_report:
            log.info(
                "worker.waiting_for_gateway",
                deployment=deployment,
                key=current_spec_key(deployment),
                waited_s=round(time.monotonic() - started, 1),
                hint="start `visiongate serve --encoder redis` on the same Redis: its encoder "
                "configuration is taken from there",
            )
            next_report += report_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), poll_s)
    return None


async def serve(
    args: argparse.Namespace,
    config: EncoderConfig,
    *,
    prog: str,
    tracer: Tracer | None = None,
    metrics: EncodeMetrics | None = None,
) -> int:
    """Wait for the gateway's encoder spec, build and warm that pipeline, then serve jobs until
    SIGTERM / SIGINT; the exit status (1: Redis unusable at start, 2: configuration conflict)."""
    from encoder_worker.deployment_follower import ConfigConflict
    from encoder_worker.worker import EncoderWorker

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def refuse(exc: Exception) -> int:
        log.error("worker.config_conflict", deployment=args.deployment, error=str(exc))
        print(f"{prog}: configuration error: {exc}", file=sys.stderr, flush=True)
        return 2

    adopter = SpecAdopter(args, config)
    try:
        client = async_client(args.redis_url, socket_connect_timeout=2.0, socket_timeout=10.0)
    except ValueError as exc:  # a malformed URL
        print(f"{prog}: configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        await client.ping()
        spec = await wait_for_spec(client, args.deployment, stop)
    except REDIS_FAILURES as exc:
        print(f"{prog}: cannot use Redis at {redacted(args.redis_url)}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        return refuse(exc)
    finally:
        await client.aclose()
    if spec is None:  # stopped while waiting
        return 0
    try:
        pipeline = await asyncio.to_thread(adopter.build, spec)
    except ConfigConflict as exc:
        return refuse(exc)
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
        deployment=args.deployment,
        build=adopter.build,
    )
    try:
        try:
            await worker.start()
        except REDIS_FAILURES as exc:
            print(f"{prog}: cannot use Redis at {redacted(args.redis_url)}: {exc}", file=sys.stderr)
            return 1
        try:
            await worker.run_until(stop)
        except ConfigConflict as exc:
            return refuse(exc)
    finally:
        await worker.aclose()
        worker.pipeline.close()
    return 0
