"""The tests' own layout: one axis, the packages. A test of `gateway/<x>/` lives under
`tests/gateway/<x>/` (a folder there that mirrors no package is a second axis), and a test's
speed is said by the `slow` marker alone, never by a `_fast` or `_slow` file name."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# tests/<folder> -> the package directory its subfolders mirror
MIRRORED = {"gateway": "gateway", "encoder_worker": "encoder_worker", "kernels": "kernels"}
SPEED_SUFFIXES = ("_fast", "_slow")


def speed_named(root: Path = ROOT) -> list[str]:
    """Test files whose name says their speed."""
    return sorted(
        str(path.relative_to(root))
        for path in (root / "tests").rglob("test_*.py")
        if path.stem.endswith(SPEED_SUFFIXES)
    )


def unmirrored(root: Path = ROOT) -> list[str]:
    """Folders under a mirrored tests/<folder> with no package directory of the same path."""
    found = []
    for tests_dir, package_dir in MIRRORED.items():
        top = root / "tests" / tests_dir
        for folder in top.rglob("*"):
            if not folder.is_dir() or folder.name == "__pycache__":
                continue
            if not (root / package_dir / folder.relative_to(top)).is_dir():
                found.append(str(folder.relative_to(root)))
    return sorted(found)


def test_the_rules_see_a_breach(tmp_path: Path) -> None:
    (tmp_path / "gateway" / "policy").mkdir(parents=True)
    (tmp_path / "tests" / "gateway" / "policy").mkdir(parents=True)
    (tmp_path / "tests" / "gateway" / "misc").mkdir()
    (tmp_path / "tests" / "gateway" / "policy" / "test_auth_fast.py").write_text("")
    (tmp_path / "tests" / "gateway" / "policy" / "test_auth.py").write_text("")
    assert unmirrored(tmp_path) == ["tests/gateway/misc"]
    assert speed_named(tmp_path) == ["tests/gateway/policy/test_auth_fast.py"]


def test_no_test_file_is_named_for_its_speed() -> None:
    found = speed_named()
    assert not found, f"mark slow tests with `pytest.mark.slow` instead of naming them: {found}"


def test_every_test_folder_mirrors_a_package() -> None:
    found = unmirrored()
    assert not found, f"test folders that mirror no package directory: {found}"
