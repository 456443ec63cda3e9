"""What installs is what the code imports, and nothing of it shadows another distribution.

`kernels/` installs as `visiongate_kernels` (setup.py): `kernels` is the import name of Hugging
Face's distribution, which transformers requires and imports when its models load. A wheel of
this project that shipped a `kernels` package would overwrite that distribution's files, and a
`kernels/__init__.py` in the repository root would shadow it in every process started there.
For the same reason the wheel ships the service alone (`gateway`, `encoder_worker`,
`visiongate_kernels`): `bench`, `dashboards` and `deploy` are the checkout's tools, run from the
repository root, and names that generic must not take a top-level place in site-packages.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from gateway.cli.dashboards_cli import NEEDS_CHECKOUT

ROOT = Path(__file__).resolve().parents[2]
# the directories the wheel is built from, and the import names it ships
SOURCES = ("gateway", "encoder_worker", "kernels")
INSTALLED = {"gateway", "encoder_worker", "visiongate_kernels"}
# the checkout's own tools: top-level names of ours too, never installed
CHECKOUT_ONLY = {"bench", "dashboards", "deploy"}


def test_transformers_loads_its_kernels_from_a_process_started_in_the_repository() -> None:
    """The failure this layout prevents: `from kernels import ...` inside transformers found
    this repository's directory and every model load raised ImportError."""
    probe = (
        "import importlib.util, transformers.activations\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(spec.origin if spec else '')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    origin = done.stdout.strip()
    assert not origin.startswith(str(ROOT / "kernels")), f"`kernels` resolves to ours: {origin}"


def test_no_top_level_name_of_ours_belongs_to_another_distribution() -> None:
    ours = INSTALLED | CHECKOUT_ONLY
    owners = importlib.metadata.packages_distributions()
    taken = {
        name: sorted(set(owners[name]) - {"visiongate"})
        for name in ours
        if set(owners.get(name, ())) - {"visiongate"}
    }
    assert not taken, f"import names also installed by other distributions: {taken}"
    assert not (ROOT / "kernels" / "__init__.py").exists()


def test_the_wheel_ships_the_service_alone_each_package_under_its_import_name(
    tmp_path: Path,
) -> None:
    """Built from a copy of the tree (a build writes build/ beside the sources), the checkout's
    tools included, so that a package list that took them in again would show."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in (*SOURCES, *sorted(CHECKOUT_ONLY)):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    build = ["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist")]
    done = subprocess.run(
        [sys.executable, "-m", "pip", *build, str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("visiongate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == INSTALLED, f"top-level names in the wheel: {sorted(tops)}"
    for module in ("int4.py", "gather.py", "resize_patchify.py", "_triton.py"):
        assert f"visiongate_kernels/{module}" in names
    assert "gateway/cli/dashboards_cli.py" in names  # the command that finds the checkout's
    # data the gateway reads at run time
    assert "gateway/server/static/index.html" in names


def _dashboards_check(cwd: Path) -> subprocess.CompletedProcess[str]:
    """`visiongate dashboards build --check` as the installed script runs it: isolated (`-I`:
    neither the current directory nor PYTHONPATH on sys.path), from `cwd`."""
    run = "from gateway.cli.main import main; raise SystemExit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; {run}", "dashboards", "build", "--check"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_dashboards_command_runs_in_the_checkout_and_says_so_elsewhere(
    tmp_path: Path,
) -> None:
    """The dashboards are not installed: `visiongate dashboards` finds them when started in
    the repository root, and anywhere else says where to run it, before anything else."""
    elsewhere = _dashboards_check(tmp_path)
    assert elsewhere.returncode == 1 and NEEDS_CHECKOUT in elsewhere.stderr, elsewhere.stderr
    in_root = _dashboards_check(ROOT)
    assert in_root.returncode == 0, in_root.stdout + in_root.stderr[-2000:]
