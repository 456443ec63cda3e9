"""Plain-JSON builders for the few Grafana panel kinds the dashboards use.

Each builder returns the dict Grafana stores (schemaVersion 39). `Layout` places panels left to
right on the 24-column grid and starts a new row when one does not fit.

Why not Grafana's own typed builders (`grafana-foundation-sdk`): tried with the release for
the Grafana we deploy (11.4), they make the same JSON through a fluent API, but
- a release exists per Grafana minor, numbered `<build>!<grafana version>`; pip's newest
  (`1769699998!10.1.0`) targets Grafana 10.1, so the pin is an epoch-exact string that must
  move with every Grafana upgrade;
- the built dashboard is not what Grafana stores either: panels come out without `id` (the
  ids the alert rules' `__panelId__` and the committed JSON rely on), so ids and the layout
  would still be ours to assign;
- three panel kinds and one layout rule here are ~200 lines, checked where it matters: the
  committed JSON is regenerated in a test, and every panel's query runs against a real
  Prometheus holding the gateway's series (tests/dashboards). A 50-module dependency would
  type the field names but check none of the queries.
So the dashboards keep these builders.
"""

from __future__ import annotations

from typing import Any

__all__ = (
    "DATASOURCE",
    "Layout",
    "dashboard",
    "datasource_variable",
    "heatmap",
    "query_variable",
    "row",
    "stat",
    "target",
    "timeseries",
)

DATASOURCE: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}
Panel = dict[str, Any]


def target(expr: str, legend: str = "", ref: str = "A", **extra: Any) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref, **extra}


def _targets(queries: list[tuple[str, str]]) -> list[dict[str, Any]]:
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(queries)]


def _thresholds(steps: list[tuple[float | None, str]]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


def timeseries(
    title: str,
    queries: list[tuple[str, str]],
    *,
    unit: str = "short",
    description: str = "",
    objective: float | None = None,
    stack: bool = False,
    minimum: float | None = 0,
    maximum: float | None = None,
) -> Panel:
    """A time series panel; ``objective`` draws a red threshold line (the SLO) at that value."""
    custom: dict[str, Any] = {
        "drawStyle": "line",
        "lineWidth": 1,
        "fillOpacity": 10 if stack else 0,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        "thresholdsStyle": {"mode": "line" if objective is not None else "off"},
    }
    defaults: dict[str, Any] = {
        "unit": unit,
        "custom": custom,
        "thresholds": _thresholds(
            [(None, "green")] + ([(objective, "red")] if objective is not None else [])
        ),
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": _targets(queries),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(
    title: str,
    expr: str,
    *,
    unit: str = "short",
    description: str = "",
    steps: list[tuple[float | None, str]] | None = None,
    decimals: int | None = None,
) -> Panel:
    defaults: dict[str, Any] = {
        "unit": unit,
        "thresholds": _thresholds(steps or [(None, "green")]),
        "color": {"mode": "thresholds"},
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [target(expr, instant=True)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "area",
            "textMode": "value",
        },
    }


def heatmap(title: str, expr: str, *, unit: str = "s", description: str = "") -> Panel:
    """A heatmap of a Prometheus histogram: ``expr`` yields per-``le`` increases."""
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [target(expr, "{{le}}", format="heatmap")],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {
            "calculate": False,
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64, "exponent": 0.5},
            "yAxis": {"unit": unit, "axisPlacement": "left"},
            "rowsFrame": {"layout": "le"},
            "tooltip": {"show": True, "yHistogram": True},
            "legend": {"show": True},
        },
    }


def row(title: str) -> Panel:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


class Layout:
    """Assigns ``id`` and ``gridPos`` in insertion order."""

    def __init__(self) -> None:
        self.panels: list[Panel] = []
        self._x = 0
        self._y = 0
        self._row_h = 0

    def add(self, panel: Panel, w: int = 12, h: int = 8) -> Layout:
        if panel["type"] == "row":
            self._newline()
            w, h = 24, 1
        elif self._x + w > 24:
            self._newline()
        grid = {"x": self._x, "y": self._y, "w": w, "h": h}
        panel = {"id": len(self.panels) + 1, "gridPos": grid, **panel}
        self.panels.append(panel)
        self._x += w
        self._row_h = max(self._row_h, h)
        if panel["type"] == "row":
            self._newline()
        return self

    def _newline(self) -> None:
        self._y += self._row_h
        self._x = 0
        self._row_h = 0


def datasource_variable() -> dict[str, Any]:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
        "options": [],
    }


def query_variable(name: str, label: str, metric: str, label_name: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": f"label_values({metric}, {label_name})",
        "query": {"query": f"label_values({metric}, {label_name})", "refId": "var"},
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
        "sort": 1,
        "hide": 0,
        "options": [],
    }


def dashboard(
    uid: str, title: str, description: str, layout: Layout, variables: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["visiongate"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "templating": {"list": [datasource_variable(), *variables]},
        "annotations": {"list": []},
        "links": [
            {
                "type": "dashboards",
                "tags": ["visiongate"],
                "asDropdown": True,
                "title": "visiongate",
            }
        ],
        "panels": layout.panels,
    }
