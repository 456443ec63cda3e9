"""The package list, which pyproject.toml cannot state: `kernels/` installs as `visiongate_kernels`.

`kernels` is the import name of Hugging Face's `kernels` distribution, which transformers
requires and imports at start-up; installing a second `kernels` would overwrite its files in
site-packages, and a `kernels/__init__.py` in the repository root would shadow it for any
process started there. Everything else (metadata, dependencies, scripts) is in pyproject.toml.

Only the service and its kernels install: `bench/`, `dashboards/` and `deploy/` are the
checkout's tools (`python -m bench.load`, `python -m deploy.stack`, `visiongate dashboards`
from the repository root), and names as generic as theirs must not take a top-level place in
site-packages.
"""

from setuptools import find_namespace_packages, setup

SHIPPED = ("gateway", "encoder_worker")

setup(
    packages=[
        *find_namespace_packages(include=[f"{name}*" for name in SHIPPED]),
        "visiongate_kernels",
    ],
    package_dir={"visiongate_kernels": "kernels"},
)
