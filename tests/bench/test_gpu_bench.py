"""The GPU check on a machine without CUDA: `python -m bench.gpu --quick` measures every CPU
figure and records each CUDA-only one as skipped with its reason; `scripts/gpu-check.sh`
reports the device, runs the gpu tests (skipped here) and the quick benchmark, and fails when
a gpu test fails. CUDA is hidden from the subprocesses, so this holds on a GPU machine too."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench._gpu_report import BATCHES
from bench._gpu_towers import QUICK_TOWERS, random_checkpoint, tower_flops

ROOT = Path(__file__).resolve().parents[2]
# one intra-op thread: tiny tensors on a CPU shared with other jobs run many times faster
# without threads that spin waiting for each other
CPU_ENV = {
    **os.environ,
    "CUDA_VISIBLE_DEVICES": "",
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
}


def expected_figures(towers) -> set[str]:
    names = {f"int4.{op}_{kind}" for op in ("pack", "unpack") for kind in ("gbps", "peak_ratio")}
    for t in towers:
        names |= {f"preprocess.{t}.{w}" for w in ("cpu_pil", "cpu_fused", "gpu_fused")}
        names |= {f"tower.{t}.tflops", f"tower.{t}.peak_ratio"}
        names |= {
            f"throughput.{t}.batch{b}.{way}" for b in BATCHES for way in ("baseline", "optimized")
        }
    return names


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu-bench")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--quick", "--out", str(out)],
        cwd=ROOT,
        env=CPU_ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out


def test_quick_run_records_every_figure(quick_run) -> None:
    proc, out = quick_run
    doc = json.loads((out / "gpu.json").read_text())
    assert doc["machine"]["device"] == "cpu" and doc["machine"]["torch"] == torch.__version__
    assert doc["settings"]["quick"] is True and doc["settings"]["batches"] == list(BATCHES)
    assert set(doc["towers"]) == set(QUICK_TOWERS)
    for name, tower in doc["towers"].items():
        assert tower["kind"] == QUICK_TOWERS[name].kind and tower["params"] > 0
    assert set(doc["figures"]) == expected_figures(QUICK_TOWERS)
    assert "errors" not in doc

    for name, fig in doc["figures"].items():
        assert isinstance(fig["unit"], str) and isinstance(fig["cuda_only"], bool), name
        if fig["cuda_only"]:
            assert "value" not in fig, name  # never a number made up for a missing device
            assert fig["skipped"] == "needs CUDA; this run is on the CPU", name
            continue
        assert "skipped" not in fig, name
        assert isinstance(fig["value"], float) and math.isfinite(fig["value"]), name
        assert fig["value"] > 0, name
        assert fig["device"].startswith("cpu") and fig["dtype"], name
        timings = fig["timings_ms"]
        flat = [t for v in timings.values() for t in v] if isinstance(timings, dict) else timings
        assert flat and all(t > 0 for t in flat), name

    png = out / "gpu.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    for tower in QUICK_TOWERS:
        assert re.search(
            rf"\[throughput {tower}\] batch 32: baseline +[\d.]+ images/s", proc.stdout
        )
    assert "[int4] pack" in proc.stdout and f"wrote {out / 'gpu.json'}" in proc.stdout


def test_quick_run_figures_follow_from_their_timings(quick_run) -> None:
    _, out = quick_run
    figs = json.loads((out / "gpu.json").read_text())["figures"]
    for t, shape in QUICK_TOWERS.items():
        fl = figs[f"tower.{t}.tflops"]
        assert fl["dtype"] == "float32" and fl["shape"]["batch"] == 32
        assert fl["flops_per_batch"] == tower_flops(shape, fl["shape"]["layers_run"], 32)
        per_s = fl["flops_per_batch"] / (statistics.median(fl["timings_ms"]) * 1e-3) / 1e12
        assert fl["value"] == pytest.approx(per_s, rel=1e-3)
        for b in BATCHES:
            base, opt = (figs[f"throughput.{t}.batch{b}.{w}"] for w in ("baseline", "optimized"))
            assert base["shape"]["batch"] == b and len(base["timings_ms"]) == 1
            assert base["value"] == pytest.approx(b / base["timings_ms"][0] * 1e3, rel=1e-3)
            assert opt["speedup_vs_baseline"] == pytest.approx(opt["value"] / base["value"])
    pack = figs["int4.pack_gbps"]
    assert pack["impl"] == "torch reference"
    assert pack["value"] == pytest.approx(
        pack["shape"]["bytes_moved"] / (statistics.median(pack["timings_ms"]) * 1e-3) / 1e9,
        rel=1e-3,
    )


@pytest.mark.parametrize("tower", sorted(QUICK_TOWERS))
def test_tower_flops_matches_torchs_count(tower, tmp_path) -> None:
    """The analytic count against torch's FLOP counter on the tower the pipeline builds.

    The counter sees every matmul (and CLIP's CLS saliency row, 2*T*D per image); whether it
    sees the fused attention depends on the device's SDPA kernel, so both totals are allowed."""
    from torch.utils.flop_counter import FlopCounterMode

    from encoder_worker.tower import build_tower

    shape = QUICK_TOWERS[tower]
    path = random_checkpoint(shape, tmp_path / tower, torch.device("cpu"))
    vt, _ = build_tower(str(path), -2, 0)
    batch, n = 2, (shape.image // shape.patch) ** 2
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        vt(torch.randn(batch, n, 3 * shape.patch**2))
    analytic = tower_flops(shape, vt.num_layers_run, batch)
    attention = batch * vt.num_layers_run * 4 * shape.tokens**2 * shape.hidden
    cls_row = 2 * batch * shape.tokens * shape.hidden if shape.kind == "clip" else 0
    assert counter.get_total_flops() in (analytic + cls_row, analytic - attention + cls_row)


def _script(env: dict[str, str], tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / "scripts" / "gpu-check.sh")],
        cwd=tmp,  # the script finds the repository from its own path
        env={**CPU_ENV, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp / "out"), **env},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_gpu_check_script_on_cpu(tmp_path) -> None:
    proc = _script(
        {
            "GPU_CHECK_QUICK": "1",
            "GPU_CHECK_TESTS": "tests/kernels",
            "GPU_CHECK_BENCH_ARGS": "--tower clip-tiny",
        },
        tmp_path,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    assert "no CUDA device: the CUDA parts are skipped" in out
    assert f"torch {torch.__version__}" in out and "triton " in out
    summary = re.search(r"^gpu tests: (\d+) skipped, \d+ deselected in [\d.]+s$", out, re.M)
    assert summary and int(summary.group(1)) > 0, out
    assert "passed" not in summary.group(0) and "failed" not in summary.group(0)
    assert "--quick --tower clip-tiny" in out
    doc = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert set(doc["towers"]) == {"clip-tiny"} and doc["settings"]["budget_s"] > 0
    assert (tmp_path / "out" / "gpu.png").is_file()
    assert "[throughput clip-tiny] batch 32" in out
    assert re.search(r"^== gpu check done in \d+s: ok$", out, re.M)


def test_gpu_check_script_fails_when_a_gpu_test_fails(tmp_path) -> None:
    tests = tmp_path / "gpu_tests"
    tests.mkdir()
    (tests / "test_broken.py").write_text(
        "import pytest\n\n\n@pytest.mark.gpu\ndef test_broken():\n    assert 1 == 2\n\n\n"
        "def test_not_gpu():\n    pass\n"
    )
    proc = _script({"GPU_CHECK_TESTS": str(tests), "GPU_CHECK_PARTS": "tests"}, tmp_path)
    out = proc.stdout
    assert proc.returncode != 0
    assert re.search(r"^gpu tests: FAILED \(exit 1\): 1 failed, 1 deselected.* in ", out, re.M), out
    assert "FAILED" in (tmp_path / "out" / "gpu-tests.log").read_text()
    assert "== benchmark" not in out  # GPU_CHECK_PARTS=tests: the later part is left out
    assert re.search(r"^== gpu check done in \d+s: FAILED$", out, re.M)


def test_a_failed_part_is_recorded_and_its_figures_marked_unmeasured(tmp_path) -> None:
    from bench._gpu_report import Report, expected_figures
    from bench.gpu import _part

    rep = Report(tmp_path / "gpu.json", {"device": "cpu"}, {"quick": True})

    def broken() -> None:
        raise RuntimeError("kernel launch failed")

    _part(rep, "int4", broken)
    rep.measured("tower.clip-tiny.tflops", 1.5, "TFLOP/s", cuda_only=False)
    expected = expected_figures({"clip-tiny": QUICK_TOWERS["clip-tiny"]})
    rep.skip_missing(expected, "not measured: a part failed (see errors)")
    rep.save()
    doc = json.loads((tmp_path / "gpu.json").read_text())
    assert rep.failed == ["int4: RuntimeError: kernel launch failed"] == doc["errors"]
    assert set(doc["figures"]) == set(expected)
    assert doc["figures"]["tower.clip-tiny.tflops"]["value"] == 1.5
    pack = doc["figures"]["int4.pack_gbps"]
    assert pack == {
        "skipped": "not measured: a part failed (see errors)",
        "unit": "GB/s",
        "cuda_only": False,
    }
    with pytest.raises(RuntimeError, match="measured 0.0"):
        rep.measured("int4.unpack_gbps", 0.0, "GB/s", cuda_only=False)
