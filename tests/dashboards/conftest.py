"""promtool for the dashboard query checks (installed on demand, like tests/deploy)."""

from __future__ import annotations

from tests.deploy.conftest import promtool  # noqa: F401 - re-exported fixture
