"""Where a kernel runs: the Triton kernel on CUDA, the torch reference elsewhere.

Kernels are written as plain Python functions and handed to `triton.jit` on first launch:
a CUDA tensor gets the compiled kernel, a CPU tensor forced onto the Triton path (tests) gets
Triton's interpreter. Nothing imports triton until a kernel is actually launched, so CPU
deployments never pay for it, and a test process can still set `TRITON_INTERPRET=1` late
(the interpreter needs it before triton's standard library is imported).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

__all__ = ("Impl", "interpreter_ready", "jit", "triton_available", "use_triton")

Impl = Literal["auto", "torch", "triton"]


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor, impl: Impl = "auto") -> bool:
    """True when `t` should go through the Triton kernel.

    `auto`: only for CUDA tensors with triton installed (and `VISIONGATE_KERNELS` not `torch`).
    `triton`: always (CPU tensors run in Triton's interpreter). `torch`: never.
    """
    if impl == "torch":
        return False
    if impl == "triton":
        if not triton_available():
            raise RuntimeError("impl='triton' but triton is not installed")
        return True
    if os.environ.get("VISIONGATE_KERNELS", "auto") == "torch":
        return False
    return t.is_cuda and triton_available()


def interpreter_ready() -> bool:
    """True when triton was (or will be) imported in interpreter mode in this process."""
    import sys

    if "triton" not in sys.modules:
        return triton_available() and os.environ.get("TRITON_INTERPRET") == "1"
    import triton.language as tl

    return type(tl.max).__name__ == "InterpretedFunction"


_JITTED: dict[tuple[Callable[..., Any], bool], Any] = {}


def jit(fn: Callable[..., Any], *, interpret: bool) -> Any:
    """`triton.jit(fn)`, compiled (interpret=False) or for Triton's CPU interpreter."""
    key = (fn, interpret)
    kernel = _JITTED.get(key)
    if kernel is None:
        if interpret and not interpreter_ready():
            raise RuntimeError(
                "Triton's interpreter needs TRITON_INTERPRET=1 before triton is imported"
            )
        import triton
        import triton.language

        # kernel bodies name `tl`; their modules leave it unimported until a launch needs it
        fn.__globals__.setdefault("tl", triton.language)
        with triton.knobs.runtime.scope():
            triton.knobs.runtime.interpret = interpret
            kernel = triton.jit(fn)
        _JITTED[key] = kernel
    return kernel
