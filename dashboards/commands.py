"""`visiongate dashboards ...`: provision or regenerate the Grafana dashboards and alert rules."""

from __future__ import annotations

import argparse
import os

__all__ = ("register",)


def _push(args: argparse.Namespace) -> int:
    from dashboards.push import push

    token = args.token or os.environ.get("GRAFANA_TOKEN")
    if not token:
        raise SystemExit("visiongate dashboards push: --token (or GRAFANA_TOKEN) is required")
    summary = push(args.url, token, folder=args.folder, datasource_uid=args.datasource_uid)
    print(
        f"folder {summary.folder_uid} ({'created' if summary.folder_created else 'existing'}); "
        f"dashboards: {', '.join(summary.dashboards) or 'none'}; alert rules created "
        f"{len(summary.rules_created)}, updated {len(summary.rules_updated)}"
    )
    return 0


def _build(args: argparse.Namespace) -> int:
    from dashboards.build import main

    return int(main(["--check"] if args.check else []) or 0)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboards",
        help="Grafana dashboards and SLO alert rules",
        description="Provision the visiongate Grafana folder, dashboards and alert rules.",
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
