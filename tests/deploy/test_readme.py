"""The metric-name table in deploy/README.md lists exactly what the gateway exports."""

from __future__ import annotations

import re

from gateway.telemetry import PROMETHEUS_NAMES
from tests.deploy.conftest import DEPLOY


def test_metric_table_matches_exporter_names() -> None:
    text = (DEPLOY / "README.md").read_text()
    pattern = r"^\| `([a-z_.]+)`(?: \([^)]*\))? \| `([a-z_:]+)` \|"
    rows = dict(re.findall(pattern, text, re.MULTILINE))
    assert rows == PROMETHEUS_NAMES
