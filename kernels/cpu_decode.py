"""The engine's CPU decode kernels, built once into one extension: `cpu_decode_module.cpp`.

- `decode_attention(q, kv_new, bufs, starts, scale)` (`decode_attention.cpp`): a decode step's
  attention for B sequences, each over its own KV buffer, writes and all, in one call a layer.
  Done in Python that is, per layer and sequence, a KV write, a few views and a call of torch's
  flash kernel, which costs tens of microseconds even for one query over a hundred keys.
- `Fp16Linear(weight)` (`decode_layers.cpp`): a float32 [N, K] matrix rounded to float16 once
  and packed for fbgemm's float16 GEMM; called with x [T, K] it gives x @ W^T in float32
  arithmetic on torch's intra-op threads (the kernel `quantized::linear_dynamic_fp16` runs).
- `DecodeLayer(ln1, ln2, qkv, o, gate_up, down)` and `decode_layers(x, cos, sin, layers, kv,
  starts, heads, kv_heads, eps, scale)`: a Llama decode step through every decoder layer in one
  call (float16 weights, float32 activations and KV), instead of about twenty Python-level
  operator calls a layer around its four products.

`load()` builds it with torch's C++ extension builder (a C++ compiler and ninja; under a minute
the first time, cached under `TORCH_EXTENSIONS_DIR`, by default `~/.cache/torch_extensions`) and
returns the module, or None when it cannot be built here; callers then keep their Python paths.
`make install` builds it once so that no server start pays for it. `VISIONGATE_KERNELS=torch`
turns it off. The build targets the machine it runs on (`-march=native`); the cache entry's name
carries a digest of the CPU's feature flags and of the sources, so a cache copied to another CPU
(or left by other sources) is not loaded.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

import structlog

__all__ = ("load",)

log = structlog.get_logger("visiongate.kernels")

_HERE = Path(__file__).parent
SOURCES = [
    _HERE / name for name in ("cpu_decode_module.cpp", "decode_attention.cpp", "decode_layers.cpp")
]
HEADERS = [_HERE / "cpu_decode.h", *sorted((_HERE / "fbgemm_shim").rglob("*.h"))]


def _digest() -> str:
    """A digest of this CPU's feature flags (Linux) and of the sources, so a build is never
    loaded on another CPU or for other sources."""
    h = hashlib.sha256()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                h.update(line.encode())
                break
    except OSError:
        pass
    for path in (*SOURCES, *HEADERS):
        h.update(path.read_bytes())
    return h.hexdigest()[:10]


@functools.cache
def load() -> Any | None:
    """The built extension, or None."""
    if os.environ.get("VISIONGATE_KERNELS") == "torch":
        return None
    try:
        from torch.utils.cpp_extension import load as build

        return build(
            name=f"visiongate_cpu_decode_{_digest()}",
            sources=[str(p) for p in SOURCES],
            # fbgemm's headers name asmjit's register types, which the wheel does not ship
            extra_include_paths=[str(_HERE), str(_HERE / "fbgemm_shim")],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the Python loop stays
        log.warning("kernels.cpu_decode.unavailable", error=f"{type(exc).__name__}: {exc}")
        return None
