"""`python -m encoder_worker --redis-url ...`: an encoder worker process on its own.

The same flags as `visiongate worker` (`process.py`). Logs are structlog's console lines at
`--log-level`; spans go to the process's global OpenTelemetry tracer provider (none unless one
is installed, e.g. by `opentelemetry-instrument`); `visiongate worker` instead sets up OTLP
export and the encode metrics from `OTEL_*`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import structlog

from encoder_worker.process import DESCRIPTION, add_worker_arguments, checked_config, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m encoder_worker", description=DESCRIPTION)
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    level = logging.getLevelNamesMapping().get(str(args.log_level).upper())
    if level is None:
        parser.error(f"--log-level {args.log_level!r}: expected debug | info | warning | error")
    config = checked_config(args, parser.prog)
    if config is None:
        return 2
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(level))
    return asyncio.run(serve(args, config, prog=parser.prog))


if __name__ == "__main__":
    sys.exit(main())
