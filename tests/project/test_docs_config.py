"""The reference pages generated from the code stay complete and current: every setting that
gateway/settings.py declares has a row on the configuration page, every stable error code is
documented, and docs/configuration.md and docs/errors.md are what docs/generate.py renders now
(after a change, run `python docs/generate.py`)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gateway.settings import Settings, declarations

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def generate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_declared_setting_has_a_row_with_its_flag_type_and_meaning(generate) -> None:
    page = generate.render()
    flags = generate.serve_flags()
    for setting in declarations():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{setting.env}` |"))
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[1] == (f"`{flags[setting.name]}`" if setting.flag else ""), setting.name
        assert cells[2] and cells[4], setting.name
    assert "| `VISIONGATE_PORT` | `--port` | int, 1..65535 | `8000` |" in page
    assert "| one of `int4`, `bf16`, `fp32` | `int4` |" in page
    assert "| float, in (0, 3600] seconds | `10.0` |" in page


def test_every_error_code_is_described(generate) -> None:
    described = generate.load_error_descriptions()
    assert generate.error_problems(described, generate.error_codes()) == []
    described.pop("busy")
    assert generate.error_problems(described, generate.error_codes()) == ["busy: no description"]


def test_the_configuration_page_lists_each_variable_once_with_its_default(generate) -> None:
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(VISIONGATE_[A-Z0-9_]+)` \|[^|]*\|[^|]*\| ([^|]*) \|", text, re.M)
    names = [name for name, _ in rows]
    assert sorted(names) == sorted(s.env for s in declarations())
    defaults = dict(rows)
    assert defaults["VISIONGATE_PORT"].strip() == f"`{Settings().port}`"
    assert defaults["VISIONGATE_REDIS_URL"].strip() == "unset"


def test_the_generated_pages_are_current(generate) -> None:
    for path, text in generate.pages().items():
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.name} is stale: run python docs/generate.py"
        )
