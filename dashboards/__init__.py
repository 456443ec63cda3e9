"""Grafana dashboards and SLO alert rules for visiongate, as code.

`build_all` makes the JSON committed under ``dashboards/json/`` (regenerate with
``python -m dashboards``); `push` provisions folder, dashboards and alert rules into a
Grafana instance through its HTTP API.
"""

from __future__ import annotations

from dashboards.alerts import RULE_GROUP, alert_rules
from dashboards.boards import (
    DASHBOARD_UIDS,
    cache_dashboard,
    encoder_dashboard,
    overview_dashboard,
)
from dashboards.build import build_all, write_all
from dashboards.push import PushSummary, push

__all__ = (
    "DASHBOARD_UIDS",
    "RULE_GROUP",
    "PushSummary",
    "alert_rules",
    "build_all",
    "cache_dashboard",
    "encoder_dashboard",
    "overview_dashboard",
    "push",
    "write_all",
)
