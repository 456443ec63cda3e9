"""promtool checks of deploy/prometheus: config syntax, rule syntax, and the rule unit tests."""

from __future__ import annotations

import subprocess

from tests.deploy.conftest import PROMETHEUS_DIR


def _promtool(promtool: str, *args: str) -> str:
    done = subprocess.run(
        [promtool, *args], check=False, capture_output=True, text=True, timeout=60,
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
