"""What installs is what the code imports, and nothing of it shadows another distribution.

`kernels/` installs as `visiongate_kernels` (setup.py): `kernels` is the import name of Hugging
Face's distribution, which transformers requires and imports when its models load. A wheel of
this project that shipped a `kernels` package would overwrite that distribution's files, and a
`kernels/__init__.py` in the repository root would shadow it in every process started there.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("gateway", "encoder_worker", "kernels", "dashboards", "bench", "deploy")


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
    ours = {"gateway", "encoder_worker", "visiongate_kernels", "dashboards", "bench", "deploy"}
    owners = importlib.metadata.packages_distributions()
    taken = {
        name: sorted(set(owners[name]) - {"visiongate"})
        for name in ours
        if set(owners.get(name, ())) - {"visiongate"}
    }
    assert not taken, f"import names also installed by other distributions: {taken}"
    assert not (ROOT / "kernels" / "__init__.py").exists()


def test_the_wheel_ships_each_package_under_its_import_name(tmp_path: Path) -> None:
    """Built from a copy of the tree (a build writes build/ beside the sources)."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SHIPPED:
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
    assert tops == {"gateway", "encoder_worker", "visiongate_kernels", "dashboards", "bench"} | {
        "deploy"
    }
    for module in ("int4.py", "gather.py", "resize_patchify.py", "_triton.py"):
        assert f"visiongate_kernels/{module}" in names
    # data the gateway and the stack read at run time
    assert "gateway/server/static/index.html" in names
    assert any(name.startswith("deploy/prometheus/rules/") for name in names)
