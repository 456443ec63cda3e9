"""The latency objectives the dashboards, Grafana alerts and Prometheus rules are built around.

deploy/prometheus/rules/ states the same numbers; a test keeps them equal.
"""

from __future__ import annotations

__all__ = (
    "BURN_RATE_PAGE",
    "ERROR_BUDGET",
    "RESPONSE_TIME_OBJECTIVE_S",
    "SLO_QUANTILE",
    "TTFT_OBJECTIVE_S",
)

SLO_QUANTILE = 0.95
ERROR_BUDGET = 1 - SLO_QUANTILE  # share of responses allowed over the objective
TTFT_OBJECTIVE_S = 2.0  # P95 time to first token
RESPONSE_TIME_OBJECTIVE_S = 10.0  # P95 duration of completed responses

# (burn rate, long window, short window) pairs that page (SRE workbook, chapter 5)
BURN_RATE_PAGE: tuple[tuple[float, str, str], ...] = ((14.4, "1h", "5m"), (6.0, "6h", "30m"))
