"""A decode step's attention on the CPU in one call a layer: `decode_attention.cpp`, built once.

The fused step (`gateway.engine.local.fused_step`) attends each decoding sequence over its own
KV buffer. Done in Python that is, per layer and sequence, a KV write, a few views and a call of
torch's flash kernel, which costs tens of microseconds even for one query over a hundred keys:
with 8 sequences, about a third of a float16 decode step. The C++ kernel does the writes and
the attention of all of a step's decoding sequences in one call a layer (about 2.7x faster than
the Python loop for 8 sequences of ~150 positions, on one thread).

`load()` builds it with torch's C++ extension builder (a C++ compiler and ninja; about 30 s the
first time, cached under `TORCH_EXTENSIONS_DIR`, by default `~/.cache/torch_extensions`) and
returns the module, or None when it cannot be built here; callers then keep the Python loop.
`make install` builds it once so that no server start pays for it. `VISIONGATE_KERNELS=torch`
turns it off. The build targets the machine it runs on (`-march=native`); the cache entry's name
carries a digest of the CPU's feature flags, so a cache copied to another CPU is not loaded.
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

SOURCE = Path(__file__).with_name("decode_attention.cpp")


def _cpu_digest() -> str:
    """A digest of this CPU's feature flags (Linux), so a build is never loaded on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return hashlib.sha256(line.encode()).hexdigest()[:10]
    except OSError:
        pass
    return "generic"


@functools.cache
def load() -> Any | None:
    """The built extension (its `decode_attention(q, kv_new, bufs, starts, scale)`), or None."""
    if os.environ.get("VISIONGATE_KERNELS") == "torch":
        return None
    try:
        from torch.utils.cpp_extension import load as build

        return build(
            name=f"visiongate_decode_attention_{_cpu_digest()}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the Python loop stays
        log.warning("kernels.decode_attention.unavailable", error=f"{type(exc).__name__}: {exc}")
        return None
