"""The reference pages generated from the code stay complete and current: every setting of
`gateway.Settings` and every stable error code is documented, nothing documented is gone from
the code, and docs/configuration.md and docs/errors.md are what docs/generate.py renders now
(after a change, run `python docs/generate.py`)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import msgspec
import pytest

from gateway.settings import ENV_PREFIX, Settings

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def generate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_setting_is_described_and_every_description_is_a_setting(generate) -> None:
    fields = list(msgspec.structs.fields(Settings))
    assert generate.problems(generate.load_descriptions(), fields) == []


def test_the_check_names_a_setting_without_a_description(generate) -> None:
    groups = generate.load_descriptions()
    removed = next(iter(groups[0]["settings"]))
    del groups[0]["settings"][removed]
    groups.append({"group": "Gone", "settings": {"no_such_setting": "text"}})
    found = generate.problems(groups, list(msgspec.structs.fields(Settings)))
    assert f"{ENV_PREFIX}{removed.upper()}: no description" in found
    assert "no_such_setting: described but not a setting" in found


def test_every_error_code_is_described(generate) -> None:
    described = generate.load_error_descriptions()
    assert generate.error_problems(described, generate.error_codes()) == []
    described.pop("busy")
    assert generate.error_problems(described, generate.error_codes()) == ["busy: no description"]


def test_the_configuration_page_lists_each_variable_once_with_its_default(generate) -> None:
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(VISIONGATE_[A-Z0-9_]+)` \|[^|]*\|[^|]*\| ([^|]*) \|", text, re.M)
    names = [name for name, _ in rows]
    fields = msgspec.structs.fields(Settings)
    assert sorted(names) == sorted(f"{ENV_PREFIX}{f.name.upper()}" for f in fields)
    defaults = dict(rows)
    assert defaults["VISIONGATE_PORT"].strip() == f"`{Settings().port}`"
    assert defaults["VISIONGATE_REDIS_URL"].strip() == "unset"


def test_the_generated_pages_are_current(generate) -> None:
    for path, text in generate.pages().items():
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.name} is stale: run python docs/generate.py"
        )
