"""`visiongate` command line: serve, demo, convert, and the ops subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ("main",)


def _settings_args(p: argparse.ArgumentParser) -> None:
    """The flags of the settings that declare one (gateway.settings), in their order. They
    default to None, so that a flag not given leaves the environment's value."""
    from gateway.settings import declarations

    g = p.add_argument_group("settings (each also VISIONGATE_<NAME>)")
    for setting in declarations():
        if setting.flag is None:
            continue
        parsing: dict = {}
        if setting.value_type is bool:
            parsing = {"action": argparse.BooleanOptionalAction, "default": None}
        elif setting.is_list:
            parsing = {"action": "append"}
        elif setting.value_type in (int, float):
            parsing = {"type": setting.value_type}
        default = setting.default
        shown = ("on" if default else "off") if isinstance(default, bool) else default
        text = setting.flag.help.format(default=shown)
        g.add_argument(setting.flag_name, dest=setting.name, help=text, **parsing)


def _overrides(args: argparse.Namespace) -> dict:
    """The settings the flags set, by name (None: not given)."""
    from gateway.settings import declarations

    return {s.name: getattr(args, s.name, None) for s in declarations() if s.flag is not None}


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

    path = ensure_default_converted(_load_settings(args).cache_dir)  # --cache-dir or the variable
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

    from gateway.cli.client_secret import register as register_client_secret
    from gateway.cli.dashboards_cli import register as register_dashboards
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
