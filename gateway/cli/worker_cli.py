"""`visiongate worker`: an encoder worker process serving gateways whose `encoder` setting is
`redis` (VISIONGATE_ENCODER=redis).

The flags and the run are the encoder worker's own (`encoder_worker.process`, also runnable as
`python -m encoder_worker`): the worker takes its encoder configuration from the gateways of its
deployment through Redis, so `--redis-url` is all it needs. This command adds the gateway's
telemetry: logging, and spans and encode metrics exported as the `OTEL_*` variables say, under
the service name `visiongate-encoder` unless OTEL_SERVICE_NAME gives another.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os

from encoder_worker.process import (
    DEFAULT_HIDDEN_SIZE,
    DEFAULT_TARGET_RMS,
    DESCRIPTION,
    add_worker_arguments,
    checked_config,
    serve,
    worker_config,
)

__all__ = ("DEFAULT_HIDDEN_SIZE", "DEFAULT_TARGET_RMS", "register", "worker_config")

_PROG = "visiongate worker"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="run an encoder worker consuming encode jobs from Redis",
        description=DESCRIPTION,
    )
    add_worker_arguments(p)
    p.set_defaults(func=cmd_worker)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("visiongate")
    except PackageNotFoundError:
        return "0.0.0"


def cmd_worker(args: argparse.Namespace) -> int:
    from gateway.telemetry import setup_telemetry

    config = checked_config(args, _PROG)
    if config is None:
        return 2
    env = dict(os.environ)
    env["OTEL_SERVICE_NAME"] = env.get("OTEL_SERVICE_NAME") or "visiongate-encoder"
    telemetry = setup_telemetry(_version(), log_level=args.log_level, env=env, set_global=True)
    try:
        return asyncio.run(
            serve(args, config, prog=_PROG, tracer=telemetry.tracer, metrics=telemetry.metrics)
        )
    finally:
        with contextlib.suppress(Exception):
            telemetry.shutdown()
