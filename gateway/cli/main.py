"""`visiongate` command line: serve, demo, convert, and the ops subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ("main",)


def _settings_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("settings (each also VISIONGATE_<NAME>)")
    g.add_argument("--host", help="bind address (default 127.0.0.1)")
    g.add_argument("--port", type=int, help="port (default 8000)")
    g.add_argument("--ssl-certfile", help="serve TLS (https, wss) with this PEM certificate chain")
    g.add_argument("--ssl-keyfile", help="the PEM private key of --ssl-certfile")
    g.add_argument(
        "--redis-url",
        help="redis://host:port/db (or redis+cluster://host:port[,host:port...] for a Redis "
        "Cluster) for sessions, caches, KV spill and encoder jobs; absent: everything in process",
    )
    g.add_argument(
        "--engine",
        help="local (default: the model runs in this process) | openai: generate on "
        "OpenAI-compatible replicas (--upstream)",
    )
    g.add_argument(
        "--upstream",
        dest="upstreams",
        action="append",
        help="with --engine openai: replica URL[,URL...], each URL[#model=NAME&api_key_env=VAR] "
        "(repeatable)",
    )
    g.add_argument("--upstream-model", help="model name sent upstream (default: each replica's)")
    g.add_argument(
        "--upstream-images",
        help="data_url (default: bytes plus content id) | embeds (pre-encoded by this gateway "
        "with --model-path, for vLLM --enable-mm-embeds)",
    )
    g.add_argument(
        "--upstream-context-tokens",
        type=int,
        help="the upstream model's context (default: what the replicas report, else 8192)",
    )
    g.add_argument(
        "--model-path",
        help="local HF checkpoint dir (default: embedded SmolLM2-135M-Instruct); "
        "a LLaVA, SmolVLM/Idefics3 or Qwen2.5-VL checkpoint is also the vision encoder",
    )
    g.add_argument(
        "--cache-dir", help="where converted models are kept (default ~/.cache/visiongate)"
    )
    g.add_argument(
        "--vision-tower", help="vit-b16-224 | vit-l14-336 | local CLIP/SigLIP checkpoint dir"
    )
    g.add_argument("--pruning", help="none | random | topk | dynamic | dynamic+merge")
    g.add_argument(
        "--visual-tokens",
        help="int4 (default) | bf16 | fp32: stored form of visual "
        "tokens (fp32 with --pruning none: exact, for VLM checkpoints)",
    )
    g.add_argument("--device", help="auto | cpu | cuda")
    g.add_argument("--lm-dtype", help="auto | float32 | bfloat16 | float16 | int8 (CPU, fastest)")
    g.add_argument(
        "--encoder", help="inproc (default) | redis: encode in `visiongate worker` processes"
    )
    g.add_argument("--log-level", help="debug | info | warning | error")
    g.add_argument("--session-ttl-s", type=int, help="idle seconds before a session is dropped")
    g.add_argument("--vision-cache-bytes", type=int, help="in-process vision cache budget")
    g.add_argument("--vision-cache-ttl-s", type=int, help="TTL of visual tokens in Redis")
    g.add_argument("--kv-budget-bytes", type=int, help="KV blocks kept across turns, all sessions")
    g.add_argument("--kv-ttl-s", type=int, help="TTL of KV blocks spilled to Redis")
    g.add_argument(
        "--engine-max-batch",
        type=int,
        help="sequences batched per step (default 16; 1: one generation at a time)",
    )
    g.add_argument(
        "--engine-max-queue",
        type=int,
        help="requests waiting for a batch slot before `busy` / HTTP 429 (default 256)",
    )
    g.add_argument(
        "--engine-max-queue-per-key",
        type=int,
        help="of those, requests of one API key (default 0: a quarter, at least 4)",
    )
    g.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        help="tokens per step: decodes plus prefill chunks (default 256)",
    )
    g.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse KV blocks by content across requests of one API key (default on)",
    )
    g.add_argument(
        "--share-encodes-across-keys",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="encode an image two API keys both sent once (default on; images stay private "
        "to each key either way)",
    )
    g.add_argument(
        "--max-pending-encodes-per-connection",
        type=int,
        help="image encodes one WebSocket may have running before `rate_limited` (default 8)",
    )
    g.add_argument(
        "--max-pending-encodes-per-key",
        type=int,
        help="image encodes one API key may have running before `rate_limited` (default 16)",
    )


def _overrides(args: argparse.Namespace) -> dict:
    keys = (
        "host",
        "port",
        "ssl_certfile",
        "ssl_keyfile",
        "redis_url",
        "engine",
        "upstreams",
        "upstream_model",
        "upstream_images",
        "upstream_context_tokens",
        "encoder",
        "lm_dtype",
        "model_path",
        "cache_dir",
        "vision_tower",
        "pruning",
        "visual_tokens",
        "device",
        "log_level",
        "session_ttl_s",
        "vision_cache_bytes",
        "vision_cache_ttl_s",
        "kv_budget_bytes",
        "kv_ttl_s",
        "engine_max_batch",
        "engine_max_queue",
        "engine_max_queue_per_key",
        "prefill_chunk_tokens",
        "prefix_caching",
        "share_encodes_across_keys",
        "max_pending_encodes_per_connection",
        "max_pending_encodes_per_key",
    )
    return {k: getattr(args, k, None) for k in keys}


def _load_settings(args: argparse.Namespace):
    from gateway.settings import Settings, SettingsError

    try:
        return Settings.load(_overrides(args))
    except SettingsError as exc:
        print(f"visiongate: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_serve(args: argparse.Namespace) -> int:
    from gateway.server.app import create_app
    from gateway.server.runner import ensure_open_files, serve
    from gateway.settings import SettingsError
    from gateway.telemetry import configure_logging

    settings = _load_settings(args)
    try:
        ensure_open_files(settings.max_connections)
    except SettingsError as exc:
        print(f"visiongate: configuration error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    serve(create_app(settings), settings)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from gateway.cli.demo import run_demo

    settings = _load_settings(args)
    return run_demo(settings, photo=args.photo, max_output_tokens=args.max_output_tokens)


def cmd_convert(args: argparse.Namespace) -> int:
    from gateway.engine.local.weights import ensure_default_converted

    path = ensure_default_converted(args.cache_dir)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="visiongate",
        description="Streaming chat gateway for vision-language models with session-aware "
        "vision caching.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "serve",
        help="run the gateway (WebSocket /v1/realtime, HTTP /v1/...)",
        description="Run the gateway. /healthz answers once it listens, /readyz once "
        "the models are loaded and warmed up.",
    )
    _settings_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "demo",
        help="start a gateway in-process and chat about a real photo",
        description="Start the gateway on a free port, run a scripted two-turn "
        "conversation about a sample photo through the Python SDK, print the "
        "streamed text and one timing line per turn, then exit.",
    )
    _settings_args(p)
    p.add_argument(
        "--photo",
        default="astronaut",
        help="a scikit-image sample photo name (astronaut, chelsea, coffee, rocket) or a file path",
    )
    p.add_argument("--max-output-tokens", type=int, default=64, help="per answer (default 64)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "convert",
        help="convert the embedded language model once (GGUF -> safetensors)",
        description="Convert the embedded SmolLM2-135M-Instruct GGUF to a safetensors "
        "checkpoint in the cache dir (done automatically on first start).",
    )
    p.add_argument("--cache-dir", help="default ~/.cache/visiongate")
    p.set_defaults(func=cmd_convert)

    from dashboards.commands import register as register_dashboards
    from gateway.cli.client_secret import register as register_client_secret
    from gateway.cli.keys import register as register_keys
    from gateway.cli.worker_cli import register as register_worker

    for register in (register_worker, register_dashboards, register_keys, register_client_secret):
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
