"""Safety net for whole-suite runs: if some earlier test module imported triton without
TRITON_INTERPRET=1 (transformers does when its vision models are imported), the in-process
interpreter comparisons skip themselves; this re-runs them in a fresh interpreter-mode process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from visiongate_kernels._triton import interpreter_ready, triton_available


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="kernels run compiled on CUDA here")
def test_interpreter_comparisons_in_a_fresh_process():
    if interpreter_ready():
        pytest.skip("the comparisons already ran in this process")
    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "interpreter",
            str(here),
        ],
        cwd=here.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
