"""Dashboards as code: the committed JSON is what the builder makes, uids are unique, every
query names only series the gateway exports, every query parses as PromQL, and the objectives
match the Prometheus rules."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from dashboards import DASHBOARD_UIDS, alert_rules, build_all
from dashboards.build import JSON_DIR, render
from dashboards.slo import (
    ITL_ALERT_FOR,
    ITL_OBJECTIVE_S,
    RESPONSE_TIME_OBJECTIVE_S,
    TTFT_OBJECTIVE_S,
)
from gateway.telemetry import Telemetry, config_from_env
from gateway.telemetry._instruments import ITL_BUCKETS_S
from tests.deploy.conftest import PROMETHEUS_DIR
from tests.gateway.telemetry.test_metrics import record_one_of_each

_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
    # aggregation operators, which may be followed by "by (...)" before their parenthesis
    "sum",
    "avg",
    "min",
    "max",
    "count",
    "group",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
}


def _exported_series() -> set[str]:
    t = Telemetry(config_from_env({}), "0", "names")
    try:
        record_one_of_each(t.metrics)
        body, _ = t.prometheus_text()
    finally:
        t.shutdown()
    return {s.name for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def _metric_names(expr: str) -> set[str]:
    """Identifiers in ``expr`` that name series (not functions, keywords or label names)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    names = set()
    for m in re.finditer(r"(?<![\w.$])([a-zA-Z_:][\w:]*)(\s*\()?", expr):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _KEYWORDS or name.startswith("__"):
            continue
        names.add(name)
    return names


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _all_exprs() -> list[tuple[str, str]]:
    exprs = []
    for name, doc in build_all().items():
        if name == "alert-rules.json":
            for rule in doc:
                exprs.append((rule["uid"], rule["data"][0]["model"]["expr"]))
            continue
        for panel in _panels(doc):
            for t in panel.get("targets", []):
                exprs.append((f"{doc['uid']}/{panel['title']}", t["expr"]))
        for var in doc["templating"]["list"]:
            if var["type"] == "query":
                exprs.append((f"{doc['uid']}/${var['name']}", var["definition"]))
    return exprs


@pytest.mark.parametrize("name", sorted(build_all()))
def test_committed_json_matches_builder(name: str) -> None:
    path = JSON_DIR / name
    assert path.exists(), f"missing {path}; run python -m dashboards"
    assert path.read_text(encoding="utf-8") == render(build_all()[name]), (
        f"{path} is stale; run python -m dashboards"
    )
    json.loads(path.read_text(encoding="utf-8"))


def test_uids_and_panel_ids_unique() -> None:
    docs = build_all()
    uids = [d["uid"] for n, d in docs.items() if n != "alert-rules.json"]
    assert sorted(uids) == sorted(DASHBOARD_UIDS)
    rule_uids = [r["uid"] for r in docs["alert-rules.json"]]
    assert len(set(uids + rule_uids)) == len(uids) + len(rule_uids)
    assert all(len(u) <= 40 for u in uids + rule_uids)  # Grafana's uid limit
    for uid in uids:
        dashboard = next(d for d in docs.values() if isinstance(d, dict) and d["uid"] == uid)
        ids = [p["id"] for p in _panels(dashboard)]
        assert len(ids) == len(set(ids)), uid
        for p in dashboard["panels"]:
            pos = p["gridPos"]
            assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, (uid, p["title"])


def test_queries_name_only_exported_metrics() -> None:
    exported = _exported_series()
    seen = set()
    for where, expr in _all_exprs():
        if expr.startswith("label_values("):
            names = {expr[len("label_values(") :].split(",")[0].strip()}
        else:
            names = _metric_names(expr)
        assert names, (where, expr)
        unknown = names - exported
        assert not unknown, f"{where}: {sorted(unknown)} not exported; query: {expr}"
        seen |= names
    # the overview shows the TTFT heatmap from the raw buckets
    assert "gen_ai_server_time_to_first_token_seconds_bucket" in seen


def test_overview_has_the_slo_panels() -> None:
    overview = build_all()["visiongate-overview.json"]
    by_title = {p["title"]: p for p in _panels(overview)}
    heat = by_title["TTFT distribution"]
    assert heat["type"] == "heatmap" and heat["targets"][0]["format"] == "heatmap"
    ttft = by_title["Time to first token vs SLO"]
    assert [t["legendFormat"] for t in ttft["targets"]] == ["p50", "p95", "p99"]
    steps = ttft["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[-1]["value"] == TTFT_OBJECTIVE_S
    rt = by_title["Response time vs SLO (completed)"]
    assert rt["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]["value"] == (
        RESPONSE_TIME_OBJECTIVE_S
    )


def test_overview_has_the_scheduler_row() -> None:
    overview = build_all()["visiongate-overview.json"]
    panels = _panels(overview)
    titles = [p["title"] for p in panels]
    start = titles.index("Scheduler")
    assert panels[start]["type"] == "row"
    row_panels = panels[start + 1 :]
    exprs = " ".join(t["expr"] for p in row_panels for t in p.get("targets", []))
    for series in (
        "visiongate_scheduler_requests",
        "visiongate_scheduler_batch_size",
        "visiongate_kv_blocks",
        "visiongate_scheduler_preemptions_total",
        "visiongate_llm_inter_token_latency_seconds_bucket",
        "gen_ai_server_time_per_output_token_seconds_bucket",
    ):
        assert series in exprs, series
    for state in ("running", "waiting"):
        assert f'state="{state}"' in exprs
    by_title = {p["title"]: p for p in row_panels}
    kv = by_title["KV blocks"]
    assert [t["legendFormat"] for t in kv["targets"]] == ["used", "cached", "free"]
    assert kv["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    latency = by_title["Inter-token latency vs objective"]
    assert [t["legendFormat"] for t in latency["targets"]] == ["ITL p50", "ITL p95", "TPOT p95"]
    assert latency["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]["value"] == (
        ITL_OBJECTIVE_S
    )
    assert "rate(visiongate_scheduler_preemptions_total[" in exprs
    # the ITL alert links to the ITL panel
    rule = next(r for r in alert_rules() if r["labels"]["slo"] == "itl")
    assert rule["annotations"]["__panelId__"] == str(latency["id"])


def test_every_query_is_valid_promql(promtool: str, tmp_path: Path) -> None:
    """promtool parses each query (Grafana variables substituted) as a recording rule."""
    rules = []
    for i, (_, expr) in enumerate(_all_exprs()):
        if expr.startswith("label_values("):
            continue
        expr = expr.replace("$__rate_interval", "5m").replace("$model", ".*")
        rules.append({"record": f"check:expr_{i}", "expr": expr})
    path = tmp_path / "exprs.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    done = subprocess.run(
        [promtool, "check", "rules", str(path)], check=False, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_objectives_match_prometheus_rules() -> None:
    alerts = yaml.safe_load((PROMETHEUS_DIR / "rules" / "visiongate-alerts.yml").read_text())
    exprs = {r["alert"]: r["expr"] for g in alerts["groups"] for r in g["rules"]}
    assert exprs["VisiongateTTFTP95AboveSLO"].strip().endswith(f"> {TTFT_OBJECTIVE_S:g}")
    assert (
        exprs["VisiongateResponseTimeP95AboveSLO"]
        .strip()
        .endswith(f"> {RESPONSE_TIME_OBJECTIVE_S:g}")
    )
    recording = (PROMETHEUS_DIR / "rules" / "visiongate-recording.yml").read_text()
    assert f'le="{TTFT_OBJECTIVE_S}"' in recording
    assert f'le="{RESPONSE_TIME_OBJECTIVE_S}"' in recording

    itl = next(
        r
        for g in alerts["groups"]
        for r in g["rules"]
        if r.get("alert") == "VisiongateITLP95AboveSLO"
    )
    assert itl["expr"].strip().endswith(f"> {ITL_OBJECTIVE_S:g}")
    assert itl["for"] == ITL_ALERT_FOR
    assert f'le="{ITL_OBJECTIVE_S}"' in recording
    assert ITL_OBJECTIVE_S in ITL_BUCKETS_S  # a bucket bound: the SLI is exact, not interpolated
    grafana = next(r for r in alert_rules() if r["labels"]["slo"] == "itl")
    assert grafana["for"] == ITL_ALERT_FOR
    assert grafana["data"][2]["model"]["conditions"][0]["evaluator"]["params"] == [ITL_OBJECTIVE_S]
    assert (
        "visiongate_llm_inter_token_latency_seconds_bucket" in grafana["data"][0]["model"]["expr"]
    )


def test_alert_rules_shape() -> None:
    rules = alert_rules(folder_uid="f", datasource_uid="ds")
    assert {r["labels"]["slo"] for r in rules} == {"ttft", "response_time", "itl"}
    for rule in rules:
        assert rule["folderUID"] == "f" and rule["condition"] == "C"
        refs = [d["refId"] for d in rule["data"]]
        assert refs == ["A", "B", "C"]
        assert rule["data"][0]["datasourceUid"] == "ds"
        assert rule["annotations"]["__dashboardUid__"] == "visiongate-overview"
