"""`visiongate dashboards ...`: provision or regenerate the Grafana dashboards and alert rules.

The dashboards and rules are defined in the checkout's `dashboards/` package, which is not
installed with the gateway (the wheel ships `gateway`, `encoder_worker` and
`visiongate_kernels` only). So the command runs where a checkout is: a `dashboards` package
importable already (a process started in the repository root), or the current directory being
the repository root (the installed `visiongate` script, as in the image's `/app`). Anywhere
else it says so and exits, before touching Grafana.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

__all__ = ("register",)

NEEDS_CHECKOUT = (
    "visiongate dashboards: the dashboards are defined in the visiongate checkout, not in the "
    "installed package; run this command from the repository root (where dashboards/ is)"
)


def checkout_module(name: str) -> ModuleType:
    """`name` (a module of the `dashboards` package) from the checkout; SystemExit when no
    checkout is at hand."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name not in ("dashboards", name):
            raise  # a module the dashboards import is missing: say that, not the above
    root = Path.cwd()
    if not (root / "dashboards" / "__init__.py").is_file():
        raise SystemExit(NEEDS_CHECKOUT)
    sys.path.insert(0, str(root))
    return importlib.import_module(name)


def _push(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get("GRAFANA_TOKEN")
    if not token:
        raise SystemExit("visiongate dashboards push: --token (or GRAFANA_TOKEN) is required")
    push = checkout_module("dashboards.push").push
    summary = push(args.url, token, folder=args.folder, datasource_uid=args.datasource_uid)
    print(
        f"folder {summary.folder_uid} ({'created' if summary.folder_created else 'existing'}); "
        f"dashboards: {', '.join(summary.dashboards) or 'none'}; alert rules created "
        f"{len(summary.rules_created)}, updated {len(summary.rules_updated)}"
    )
    return 0


def _build(args: argparse.Namespace) -> int:
    main = checkout_module("dashboards.build").main
    return int(main(["--check"] if args.check else []) or 0)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboards",
        help="Grafana dashboards and SLO alert rules (from the repository root)",
        description="Provision the visiongate Grafana folder, dashboards and alert rules. "
        "Runs from the repository root: the dashboards are defined in the checkout.",
    )
    inner = p.add_subparsers(dest="dashboards_command", required=True, metavar="ACTION")
    push = inner.add_parser(
        "push",
        help="provision folder, dashboards and alert rules with grafana-client",
        description="Create or update the folder, the dashboards and the SLO alert "
        "rules in a Grafana instance (idempotent).",
    )
    push.add_argument("--url", required=True, help="Grafana base URL, e.g. http://grafana:3000")
    push.add_argument("--token", help="service-account token (default: $GRAFANA_TOKEN)")
    push.add_argument("--folder", default="visiongate", help="folder title (default visiongate)")
    push.add_argument(
        "--datasource-uid",
        default="visiongate-prometheus",
        help="uid of the Prometheus datasource the panels and rules query",
    )
    push.set_defaults(func=_push)
    build = inner.add_parser(
        "build",
        help="regenerate the committed dashboard JSON (or --check it)",
        description="Write dashboards/json/*.json from the Python definitions.",
    )
    build.add_argument("--check", action="store_true", help="exit 1 if the committed JSON is stale")
    build.set_defaults(func=_build)
