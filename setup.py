"""The package list, which pyproject.toml cannot state: `kernels/` installs as `visiongate_kernels`.

`kernels` is the import name of Hugging Face's `kernels` distribution, which transformers
requires and imports at start-up; installing a second `kernels` would overwrite its files in
site-packages, and a `kernels/__init__.py` in the repository root would shadow it for any
process started there. Everything else (metadata, dependencies, scripts) is in pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

SHIPPED = ("gateway", "encoder_worker", "dashboards", "bench", "deploy")

setup(
    packages=[
        *find_namespace_packages(include=[f"{name}*" for name in SHIPPED]),
        "visiongate_kernels",
    ],
    package_dir={"visiongate_kernels": "kernels"},
)
