"""promtool checks of deploy/prometheus: config syntax, rule syntax, and the rule unit tests,
which must make every alert fire at least once."""

from __future__ import annotations

import subprocess

import yaml

from tests.deploy.conftest import PROMETHEUS_DIR


def _promtool(promtool: str, *args: str) -> str:
    done = subprocess.run(
        [promtool, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=PROMETHEUS_DIR.parent,
    )
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def test_config_is_valid(promtool: str) -> None:
    out = _promtool(promtool, "check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert "2 rule files found" in out


def test_rules_are_valid(promtool: str) -> None:
    rules = sorted(str(p) for p in (PROMETHEUS_DIR / "rules").glob("*.yml"))
    assert len(rules) == 2
    _promtool(promtool, "check", "rules", *rules)


def test_rule_unit_tests_pass(promtool: str) -> None:
    tests = sorted(str(p) for p in (PROMETHEUS_DIR / "tests").glob("*.yml"))
    assert tests
    out = _promtool(promtool, "test", "rules", *tests)
    assert "SUCCESS" in out


def test_every_alert_fires_in_a_unit_test() -> None:
    alerts = {
        rule["alert"]
        for path in (PROMETHEUS_DIR / "rules").glob("*.yml")
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    assert "VisiongateITLP95AboveSLO" in alerts
    fired = {
        check["alertname"]
        for path in (PROMETHEUS_DIR / "tests").glob("*.yml")
        for case in yaml.safe_load(path.read_text())["tests"]
        for check in case.get("alert_rule_test", [])
        if check.get("exp_alerts")
    }
    assert alerts <= fired, f"alerts no unit test makes fire: {sorted(alerts - fired)}"
