"""promtool and prometheus for the dashboard query checks (installed on demand, like
tests/deploy)."""

from __future__ import annotations

from tests.deploy.conftest import prometheus_bin, promtool  # noqa: F401 - re-exported fixtures
