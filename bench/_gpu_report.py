"""What a GPU benchmark run (`bench.gpu`) records: its figures, gpu.json and gpu.png.

`expected_figures` names every figure a run over some towers records (unit, and whether only
CUDA can measure it), so a run cut short, or one on a machine without CUDA, still lists each
one, as measured or as skipped with its reason. `Report` builds gpu.json, rewritten after each
part; `plot` draws gpu.png from it. Figures are never invented: a value that is not finite and
positive is refused.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from bench._gpu_towers import TowerShape

__all__ = ("BATCHES", "FLOPS_BATCH", "Report", "expected_figures", "plot")

BATCHES = (1, 8, 32)
FLOPS_BATCH = 32


def expected_figures(towers: dict[str, TowerShape]) -> dict[str, tuple[str, bool]]:
    """Every figure a run over `towers` records: name -> (unit, CUDA only)."""
    figs = {}
    for op in ("pack", "unpack"):
        figs[f"int4.{op}_gbps"] = ("GB/s", False)
        figs[f"int4.{op}_peak_ratio"] = ("fraction of --peak-gbps", True)
    for t in towers:
        for way in ("cpu_pil", "cpu_fused", "gpu_fused"):
            figs[f"preprocess.{t}.{way}"] = ("ms/image", way.startswith("gpu"))
        figs[f"tower.{t}.tflops"] = ("TFLOP/s", False)
        figs[f"tower.{t}.peak_ratio"] = ("fraction of --peak-tflops", True)
        for b in BATCHES:
            for way in ("baseline", "optimized"):
                figs[f"throughput.{t}.batch{b}.{way}"] = ("images/s", False)
    return figs


class Report:
    """gpu.json as it is built: each figure is measured (value, unit, device, dtype, shape,
    timings) or skipped with its reason; the file is rewritten after every part."""

    def __init__(self, path: Path, machine: dict, settings: dict) -> None:
        self.path = path
        self.doc = {"machine": machine, "settings": settings, "towers": {}, "figures": {}}
        self.failed: list[str] = []
        self.t0 = time.monotonic()

    def measured(self, name: str, value: float, unit: str, *, cuda_only: bool, **fields) -> None:
        if not (value > 0 and np.isfinite(value)):
            raise RuntimeError(f"{name}: measured {value!r} {unit}")
        rec = {"value": float(value), "unit": unit, "cuda_only": cuda_only}
        rec.update(fields)
        self.doc["figures"][name] = rec

    def skipped(self, name: str, unit: str, reason: str, cuda_only: bool) -> None:
        self.doc["figures"][name] = {"skipped": reason, "unit": unit, "cuda_only": cuda_only}

    def skip_missing(self, expected: dict[str, tuple[str, bool]], reason: str) -> None:
        """Record each expected figure that has no record yet as skipped for `reason`."""
        for name, (unit, cuda_only) in expected.items():
            if name not in self.doc["figures"]:
                self.skipped(name, unit, reason, cuda_only)

    def save(self) -> None:
        self.doc["elapsed_s"] = round(time.monotonic() - self.t0, 2)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=2))
        os.replace(tmp, self.path)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs, m = doc["figures"], doc["machine"]
    towers = list(doc["towers"])

    def val(name: str) -> float:
        return figs.get(name, {}).get("value", 0.0)

    fig, ((ax1, ax2), (ax3, ax4)) = plt.subplots(2, 2, figsize=(13, 9))
    x = np.arange(len(BATCHES))
    width = 0.8 / max(2 * len(towers), 1)
    for i, tower in enumerate(towers):
        for j, way in enumerate(("baseline", "optimized")):
            vals = [val(f"throughput.{tower}.batch{b}.{way}") for b in BATCHES]
            k = 2 * i + j
            ax1.bar(x - 0.4 + (k + 0.5) * width, vals, width, label=f"{tower} {way}")
    ax1.set_xticks(x, [f"batch {b}" for b in BATCHES])
    ax1.set_ylabel("images / s")
    ax1.set_title("baseline vs optimized pipeline")
    ax1.legend(fontsize=7)

    ways = ("cpu_pil", "cpu_fused", "gpu_fused")
    for i, tower in enumerate(towers):
        vals = [val(f"preprocess.{tower}.{w}") for w in ways]
        ax2.bar(np.arange(3) + (i - 0.5) * 0.4, vals, 0.4, label=tower)
        if i == 0 and "skipped" in figs.get(f"preprocess.{tower}.gpu_fused", {}):
            ax2.text(2, 0, "skipped:\nno CUDA", ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(np.arange(3), ["CPU Pillow", "CPU fused", "GPU fused"])
    ax2.set_ylabel("ms per image")
    ax2.set_title("preprocessing on real photos")
    ax2.legend(fontsize=7)

    peak = doc["settings"]["peak_tflops"]
    tf = [val(f"tower.{t}.tflops") for t in towers]
    ax3.bar(towers, tf, color="tab:blue")
    if m["device"].startswith("cuda"):
        ax3.axhline(peak, color="tab:red", linestyle="--", label=f"peak {peak:g}")
        ax3.legend(fontsize=7)
    ax3.set_ylabel("TFLOP/s")
    ratios = [figs.get(f"tower.{t}.peak_ratio", {}).get("value") for t in towers]
    shown = ", ".join(f"{r:.0%}" for r in ratios if r is not None) or "no CUDA, no peak"
    ax3.set_title(f"tower at batch {FLOPS_BATCH} ({shown})")

    gb = doc["settings"]["peak_gbps"]
    ax4.bar(["pack", "unpack"], [val("int4.pack_gbps"), val("int4.unpack_gbps")], color="tab:green")
    if m["device"].startswith("cuda"):
        ax4.axhline(gb, color="tab:red", linestyle="--", label=f"peak {gb:g} GB/s")
        ax4.legend(fontsize=7)
    ax4.set_ylabel("GB/s")
    ax4.set_title("INT4 visual tokens")
    mode = "quick, tiny shapes" if doc["settings"]["quick"] else "real shapes"
    fig.suptitle(f"visiongate encoder on {m['device_name']} ({mode}, torch {m['torch']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
