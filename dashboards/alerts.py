"""Grafana-managed alert rules for the latency SLOs, as provisioning-API payloads.

The same objectives as deploy/prometheus/rules (threshold on the 5-minute P95, and the fast
multi-window burn-rate page; for inter-token latency the threshold only), written against raw
gateway series so they need no recording rules. Each rule is three queries: A the PromQL,
B reduce to the last value, C the threshold.
"""

from __future__ import annotations

from typing import Any

from dashboards.boards import DURATION, ITL, ITL_PANEL, TTFT, overview_dashboard
from dashboards.slo import (
    BURN_RATE_PAGE,
    ERROR_BUDGET,
    ITL_ALERT_FOR,
    ITL_OBJECTIVE_S,
    RESPONSE_TIME_OBJECTIVE_S,
    TTFT_OBJECTIVE_S,
)

__all__ = ("RULE_GROUP", "alert_rules")

RULE_GROUP = "visiongate-slo"
_EXPR = {"type": "__expr__", "uid": "__expr__"}
# overview panels the alerts link to
TTFT_PANEL = "Time to first token vs SLO"
RT_PANEL = "Response time vs SLO (completed)"
SLI_PANEL = "Share of responses within objective"


def _p95(metric: str, selector: str) -> str:
    return f"histogram_quantile(0.95, sum by (le) (rate({metric}_bucket{selector}[5m])))"


def _error_ratio(metric: str, objective: float, extra: str, window: str) -> str:
    sel = f'{{le="{objective}"{extra}}}'
    count_sel = f"{{{extra.lstrip(', ')}}}" if extra else ""
    return (
        f"(1 - sum(rate({metric}_bucket{sel}[{window}])) / "
        f"sum(rate({metric}_count{count_sel}[{window}])))"
    )


def _burn(metric: str, objective: float, extra: str = "") -> str:
    """Error ratio when a page-level burn holds on both windows of a pair; empty otherwise."""
    pairs = []
    for rate, long_w, short_w in BURN_RATE_PAGE:
        limit = round(rate * ERROR_BUDGET, 6)
        pairs.append(
            f"({_error_ratio(metric, objective, extra, long_w)} > {limit} and "
            f"{_error_ratio(metric, objective, extra, short_w)} > {limit})"
        )
    return " or ".join(pairs)


def _rule(
    *,
    uid: str,
    title: str,
    expr: str,
    threshold: float,
    pending: str,
    folder_uid: str,
    datasource_uid: str,
    labels: dict[str, str],
    summary: str,
    dashboard_uid: str,
    panel_id: int,
) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "ruleGroup": RULE_GROUP,
        "folderUID": folder_uid,
        "orgID": 1,
        "condition": "C",
        "for": pending,
        "noDataState": "OK",
        "execErrState": "Error",
        "isPaused": False,
        "labels": {"service": "visiongate", **labels},
        "annotations": {
            "summary": summary,
            "__dashboardUid__": dashboard_uid,
            "__panelId__": str(panel_id),
        },
        "data": [
            {
                "refId": "A",
                "queryType": "",
                "relativeTimeRange": {"from": 600, "to": 0},
                "datasourceUid": datasource_uid,
                "model": {
                    "refId": "A",
                    "expr": expr,
                    "instant": True,
                    "range": False,
                    "intervalMs": 1000,
                    "maxDataPoints": 43200,
                },
            },
            {
                "refId": "B",
                "queryType": "",
                "relativeTimeRange": {"from": 0, "to": 0},
                "datasourceUid": "__expr__",
                "model": {
                    "refId": "B",
                    "type": "reduce",
                    "expression": "A",
                    "reducer": "last",
                    "datasource": _EXPR,
                },
            },
            {
                "refId": "C",
                "queryType": "",
                "relativeTimeRange": {"from": 0, "to": 0},
                "datasourceUid": "__expr__",
                "model": {
                    "refId": "C",
                    "type": "threshold",
                    "expression": "B",
                    "conditions": [{"evaluator": {"type": "gt", "params": [threshold]}}],
                    "datasource": _EXPR,
                },
            },
        ],
    }


def _overview_panel(title: str) -> int:
    """The overview panel an alert links to (Grafana shows it beside the alert)."""
    return next(p["id"] for p in overview_dashboard()["panels"] if p["title"] == title)


def alert_rules(
    folder_uid: str = "visiongate", datasource_uid: str = "visiongate-prometheus"
) -> list[dict[str, Any]]:
    """The SLO alert rules, bound to a Grafana folder and a Prometheus datasource uid."""
    common = {
        "folder_uid": folder_uid,
        "datasource_uid": datasource_uid,
        "dashboard_uid": "visiongate-overview",
    }
    completed = ', status="completed"'
    return [
        _rule(
            uid="visiongate-ttft-p95",
            title="visiongate P95 TTFT above objective",
            expr=_p95(TTFT, ""),
            threshold=TTFT_OBJECTIVE_S,
            pending="10m",
            labels={"severity": "warning", "slo": "ttft"},
            panel_id=_overview_panel(TTFT_PANEL),
            summary=f"P95 time to first token above {TTFT_OBJECTIVE_S:g} s for 10 minutes",
            **common,
        ),
        _rule(
            uid="visiongate-response-p95",
            title="visiongate P95 response time above objective",
            expr=_p95(DURATION, '{status="completed"}'),
            threshold=RESPONSE_TIME_OBJECTIVE_S,
            pending="10m",
            labels={"severity": "warning", "slo": "response_time"},
            panel_id=_overview_panel(RT_PANEL),
            summary=f"P95 response time above {RESPONSE_TIME_OBJECTIVE_S:g} s for 10 minutes",
            **common,
        ),
        _rule(
            uid="visiongate-ttft-burn",
            title="visiongate TTFT error budget burn",
            expr=_burn(TTFT, TTFT_OBJECTIVE_S),
            threshold=0,
            pending="2m",
            labels={"severity": "page", "slo": "ttft"},
            panel_id=_overview_panel(SLI_PANEL),
            summary="TTFT error budget burning at 14.4x (1h/5m) or 6x (6h/30m)",
            **common,
        ),
        _rule(
            uid="visiongate-response-burn",
            title="visiongate response-time error budget burn",
            expr=_burn(DURATION, RESPONSE_TIME_OBJECTIVE_S, completed),
            threshold=0,
            pending="2m",
            labels={"severity": "page", "slo": "response_time"},
            panel_id=_overview_panel(SLI_PANEL),
            summary="Response-time error budget burning at 14.4x (1h/5m) or 6x (6h/30m)",
            **common,
        ),
        _rule(
            uid="visiongate-itl-p95",
            title="visiongate P95 inter-token latency above objective",
            expr=_p95(ITL, ""),
            threshold=ITL_OBJECTIVE_S,
            pending=ITL_ALERT_FOR,
            labels={"severity": "warning", "slo": "itl"},
            panel_id=_overview_panel(ITL_PANEL),
            summary=f"P95 inter-token latency above {ITL_OBJECTIVE_S * 1000:g} ms for "
            f"{ITL_ALERT_FOR.removesuffix('m')} minutes",
            **common,
        ),
    ]
