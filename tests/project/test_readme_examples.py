"""The README's examples run as written: each ```python block, in order and in one namespace
(the HTTP examples share their client), against a live gateway over the fake engine and
encoder, with only the address changed and `photo.jpg` a real photo in the working directory.
Its links into the repository (the docs pages) name files that exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.testing.fake_gateway import FakeGateway
from tests.conftest import photo_bytes

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_the_readme_has_one_example_per_api() -> None:
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    calls = ("RealtimeClient.connect", "chat.completions.create", "responses.create")
    for call in calls:
        assert sum(call in block for block in blocks) == 1, call
    assert sum("client.completions.create" in block for block in blocks) == 1


def test_the_readme_links_name_files_that_exist() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text(encoding="utf-8"))
    local = [link for link in links if "://" not in link]
    assert local, "the README links no docs page"
    missing = [link for link in local if not (README.parent / link).exists()]
    assert missing == []


def test_the_readme_examples_run_against_a_gateway(
    fake_gateway: FakeGateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "photo.jpg").write_bytes(photo_bytes("astronaut"))
    namespace: dict = {}
    for block in python_blocks(README.read_text(encoding="utf-8")):
        assert "127.0.0.1:8000" in block or "client." in block
        code = block.replace("ws://127.0.0.1:8000/v1/realtime", fake_gateway.ws_url).replace(
            "http://127.0.0.1:8000", fake_gateway.http_url
        )
        exec(compile(code, str(README), "exec"), namespace)
        printed = capsys.readouterr().out
        assert printed.strip(), f"an example printed nothing:\n{block}"
