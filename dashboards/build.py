"""Generate the committed dashboard and alert-rule JSON under dashboards/json/.

python -m dashboards          # rewrite the files
python -m dashboards --check  # exit 1 if the committed files are stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dashboards.alerts import alert_rules
from dashboards.boards import cache_dashboard, encoder_dashboard, overview_dashboard

__all__ = ("JSON_DIR", "build_all", "main", "render", "write_all")

JSON_DIR = Path(__file__).resolve().parent / "json"


def build_all() -> dict[str, Any]:
    """File name -> JSON document, for every generated file."""
    return {
        "visiongate-overview.json": overview_dashboard(),
        "visiongate-encoder.json": encoder_dashboard(),
        "visiongate-cache.json": cache_dashboard(),
        "alert-rules.json": alert_rules(),
    }


def render(document: Any) -> str:
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_all(directory: Path = JSON_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, document in build_all().items():
        path = directory / name
        path.write_text(render(document), encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed JSON is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = [
            name
            for name, doc in build_all().items()
            if not (JSON_DIR / name).exists()
            or (JSON_DIR / name).read_text(encoding="utf-8") != render(doc)
        ]
        for name in stale:
            print(f"stale: dashboards/json/{name}", file=sys.stderr)
        return 1 if stale else 0
    for path in write_all():
        print(path)
    return 0
