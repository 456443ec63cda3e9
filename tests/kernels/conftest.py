"""Kernel tests compare each Triton kernel with its torch reference.

Without CUDA they run in Triton's interpreter on the CPU, which needs TRITON_INTERPRET=1 before
triton is first imported: set here, at conftest import, before any test module loads (the
`visiongate_kernels` package itself imports triton only when a kernel launches). With CUDA the
kernels are compiled and run for real (`gpu` marker).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=["interpreter", pytest.param("cuda", marks=pytest.mark.gpu)])
def kernel_device(request) -> torch.device:
    """Where the Triton side of a comparison runs."""
    from visiongate_kernels._triton import interpreter_ready, triton_available

    if not triton_available():
        pytest.skip("triton is not installed")
    if request.param == "interpreter":
        if not interpreter_ready():
            pytest.skip("triton was imported without TRITON_INTERPRET=1 in this process")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if interpreter_ready():
        pytest.skip("triton runs interpreted in this process")
    return torch.device("cuda")
