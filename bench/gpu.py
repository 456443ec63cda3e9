"""GPU benchmark of the encoder: pipelines, preprocessing, tower FLOP/s and INT4 bandwidth.

    python -m bench.gpu --out DIR [--quick] [--peak-tflops 790] [--peak-gbps 4300]

What it measures, on CUDA when present (else on the CPU):
- images/s of the classic pipeline vs `EncoderPipeline` at batch 1, 8 and 32 (the code paths of
  `bench.encoder`: `Baseline`, `throughput`), with random-weight towers of real shapes: CLIP
  ViT-L/14@336 and SigLIP so400m-patch14-384, built from transformers' own configs and written
  as local safetensors checkpoints (nothing is downloaded), so both pipelines load them the
  way they load a real checkpoint;
- preprocessing ms per image on real photos (skimage.data): Pillow (`pil_preprocess`) and the
  fused step (`preprocess_batch`) on the CPU, and the fused step on the GPU (Triton kernel,
  host-to-device copy of the uint8 image included);
- the tower's achieved TFLOP/s at batch 32 in the pipeline's dtype (bf16 on CUDA), against
  `--peak-tflops`;
- INT4 pack and unpack GB/s (`visiongate_kernels.int4`; Triton on CUDA), against `--peak-gbps`.

`--quick`: tiny towers of the same two families and small tensors, one timed round; seconds on a
CPU. Figures are never invented: what needs CUDA is recorded as skipped, with the reason, when
there is none; a part that fails or does not fit in `--budget-s` is recorded as such, and the
exit status is 1 if any part failed.

Timing: warm-up calls first (CUDA: kernels compiled and autotuned); kernel-only figures are
timed with CUDA events read after one synchronize; whole pipelines by wall clock, as both wait
for the device before returning. Writes DIR/gpu.json (rewritten after each part, so a run cut
short keeps what it measured) and DIR/gpu.png. The towers' shapes and checkpoints:
`bench/_gpu_towers.py`; the figures, gpu.json and gpu.png: `bench/_gpu_report.py`.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench._gpu_report import BATCHES, FLOPS_BATCH, Report, expected_figures, plot
from bench._gpu_towers import QUICK_TOWERS, TOWERS, TowerShape, random_checkpoint, tower_flops
from bench.encoder import Baseline, photo_bytes, throughput
from encoder_worker.config import EncoderConfig
from encoder_worker.patch_rows import pil_preprocess, preprocess_batch
from encoder_worker.pipeline import EncoderPipeline
from visiongate_kernels._triton import use_triton
from visiongate_kernels.int4 import dequantize_int4, quantize_int4

__all__ = ("main",)


def _time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> list:
    """ms per call of `fn` after `warmup` untimed calls.

    On CUDA each call sits between two events on the current stream, read after one
    synchronize at the end (host time spent between them counts when the GPU waits for it)."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        out = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
        return out
    torch.cuda.synchronize(device)
    pairs = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in pairs]


def _where(args: argparse.Namespace, device: torch.device) -> str:
    """The device a figure was measured on, as gpu.json records it."""
    return args.device_name if device.type == "cuda" else args.cpu_name


def _r(xs: list[float]) -> list[float]:
    return [round(x, 4) for x in xs]


# -- parts ---------------------------------------------------------------------------------------


@torch.inference_mode()
def bench_int4(rep: Report, args: argparse.Namespace, device: torch.device) -> None:
    """INT4 pack (quantize) and unpack (dequantize) of fp32 tokens, in GB/s of bytes moved."""
    n, d, group = (512, 576, 64) if args.quick else (65536, 4096, 64)
    x = torch.randn(n, d, device=device)
    impl = "triton" if use_triton(x) else "torch reference"
    packed, scales = quantize_int4(x, group)
    small = packed.numel() + scales.numel() * 2  # bytes of the packed form
    iters = 2 if args.quick else 20
    for op, fn, nbytes in (
        ("pack", lambda: quantize_int4(x, group), x.numel() * 4 + small),
        ("unpack", lambda: dequantize_int4(packed, scales, d, group), small + n * d * 4),
    ):
        ms = _time_ms(fn, device, warmup=1 if args.quick else 3, iters=iters)
        gbps = nbytes / (statistics.median(ms) * 1e-3) / 1e9
        shape = {"tokens": n, "hidden": d, "group": group, "bytes_moved": nbytes}
        rep.measured(
            f"int4.{op}_gbps",
            gbps,
            "GB/s",
            cuda_only=False,
            device=_where(args, device),
            dtype="float32 <-> int4",
            impl=impl,
            shape=shape,
            timings_ms=_r(ms),
        )
        line = f"[int4] {op:<7}{gbps:>10.1f} GB/s  ({impl}, {n}x{d} fp32, group {group})"
        if device.type == "cuda":
            rep.measured(
                f"int4.{op}_peak_ratio",
                gbps / args.peak_gbps,
                "fraction of --peak-gbps",
                cuda_only=True,
                device=args.device_name,
                peak_gbps=args.peak_gbps,
            )
            line += f"  {gbps / args.peak_gbps:.1%} of {args.peak_gbps:g} GB/s"
        else:
            rep.skipped(f"int4.{op}_peak_ratio", "fraction of --peak-gbps", args.no_cuda, True)
        print(line, flush=True)


def _photos() -> dict[str, np.ndarray]:
    return {
        name: np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy()
        for name, data in photo_bytes().items()
    }


@torch.inference_mode()
def bench_preprocess(
    rep: Report, args: argparse.Namespace, pipe: EncoderPipeline, tower: str
) -> None:
    """ms per image of Pillow vs the fused step on the CPU, and the fused step on the GPU."""
    photos = _photos()
    iters, warmup = (1, 1) if args.quick else (10, 3)
    cpu, device, dtype, spec = torch.device("cpu"), pipe.device, pipe.dtype, pipe.spec
    ways = {
        "cpu_pil": (cpu, lambda a, t: pil_preprocess(a, spec), "float32"),
        "cpu_fused": (
            cpu,
            lambda a, t: preprocess_batch([t], spec, cpu, torch.float32),
            "float32",
        ),
    }
    if device.type == "cuda":
        ways["gpu_fused"] = (
            device,
            lambda a, t: preprocess_batch([t], spec, device, dtype),
            str(dtype).removeprefix("torch."),
        )
    else:
        rep.skipped(f"preprocess.{tower}.gpu_fused", "ms/image", args.no_cuda, cuda_only=True)
    shape = {
        "image_size": spec.image_size,
        "patch": spec.patch_size,
        "resize": spec.resize,
        "resample": spec.resample,
        "photos": {k: list(v.shape) for k, v in photos.items()},
    }
    medians: dict[str, float] = {}
    for way, (dev, fn, dt) in ways.items():
        per_photo = {}
        for name, arr in photos.items():
            t = torch.from_numpy(arr)
            per_photo[name] = _time_ms(lambda a=arr, t=t, fn=fn: fn(a, t), dev, warmup, iters)
        medians[way] = statistics.fmean(statistics.median(v) for v in per_photo.values())
        rep.measured(
            f"preprocess.{tower}.{way}",
            medians[way],
            "ms/image",
            cuda_only=way.startswith("gpu"),
            device=_where(args, dev),
            dtype=dt,
            shape=shape,
            timings_ms={k: _r(v) for k, v in per_photo.items()},
        )
    line = ", ".join(f"{k} {v:.3f}" for k, v in medians.items())
    if "gpu_fused" in medians:
        line += f"  (gpu {medians['cpu_pil'] / medians['gpu_fused']:.1f}x faster than pil)"
    print(f"[preprocess {tower}] ms/image: {line}", flush=True)


@torch.inference_mode()
def bench_tower_flops(
    rep: Report, args: argparse.Namespace, pipe: EncoderPipeline, name: str, shape: TowerShape
) -> None:
    """The pipeline's own tower (truncated at its feature layer) on a batch of 32 images."""
    tower, device = pipe.tower, pipe.device
    patches = torch.randn(
        FLOPS_BATCH, pipe.spec.num_patches, 3 * shape.patch**2, device=device, dtype=pipe.dtype
    )  # [B, N, 3*P*P]
    flops = tower_flops(shape, tower.num_layers_run, FLOPS_BATCH)
    ms = _time_ms(lambda: tower(patches), device, *((1, 1) if args.quick else (3, 10)))
    tflops = flops / (statistics.median(ms) * 1e-3) / 1e12
    dtype = str(pipe.dtype).removeprefix("torch.")
    rep.measured(
        f"tower.{name}.tflops",
        tflops,
        "TFLOP/s",
        cuda_only=False,
        device=_where(args, device),
        dtype=dtype,
        shape={
            **shape._asdict(),
            "batch": FLOPS_BATCH,
            "tokens": shape.tokens,
            "layers_run": tower.num_layers_run,
        },
        flops_per_batch=flops,
        timings_ms=_r(ms),
    )
    line = f"[tower {name}] {tflops:.2f} TFLOP/s at batch {FLOPS_BATCH} {dtype}"
    if device.type == "cuda":
        rep.measured(
            f"tower.{name}.peak_ratio",
            tflops / args.peak_tflops,
            "fraction of --peak-tflops",
            cuda_only=True,
            device=args.device_name,
            dtype=dtype,
            peak_tflops=args.peak_tflops,
        )
        line += f"  {tflops / args.peak_tflops:.1%} of {args.peak_tflops:g}"
    else:
        rep.skipped(f"tower.{name}.peak_ratio", "fraction of --peak-tflops", args.no_cuda, True)
    print(line, flush=True)


def bench_throughput(
    rep: Report,
    args: argparse.Namespace,
    pipe: EncoderPipeline,
    base: Baseline,
    name: str,
    shape: TowerShape,
) -> None:
    datas = list(photo_bytes().values())
    dtype = str(pipe.dtype).removeprefix("torch.")
    for batch in BATCHES:
        if args.over_budget():
            for way in ("baseline", "optimized"):
                rep.skipped(
                    f"throughput.{name}.batch{batch}.{way}", "images/s", args.budget_reason, False
                )
            continue
        rates = throughput(base, pipe, datas, batch, args.repeats, warmup=args.warmup)
        med = {k: statistics.median(v) for k, v in rates.items()}
        for way, values in rates.items():
            extra = {}
            if way == "optimized":
                extra["speedup_vs_baseline"] = med["optimized"] / med["baseline"]
            rep.measured(
                f"throughput.{name}.batch{batch}.{way}",
                med[way],
                "images/s",
                cuda_only=False,
                device=_where(args, pipe.device),
                dtype=dtype,
                shape={**shape._asdict(), "batch": batch, "max_batch": pipe.config.max_batch},
                timings_ms=_r([batch / r * 1e3 for r in values]),
                **extra,
            )
        print(
            f"[throughput {name}] batch {batch:>2}: baseline {med['baseline']:8.2f} images/s, "
            f"optimized {med['optimized']:8.2f} ({med['optimized'] / med['baseline']:.2f}x)",
            flush=True,
        )
        rep.save()


def bench_tower(
    rep: Report, args: argparse.Namespace, name: str, shape: TowerShape, tmp: Path
) -> None:
    """Build the random-weight checkpoint, then its preprocessing, FLOP/s and throughput."""
    t0 = time.perf_counter()
    print(f"[tower {name}] writing a random-weight checkpoint {tuple(shape)} ...", flush=True)
    path = random_checkpoint(shape, tmp / name, args.init_device)
    cfg = EncoderConfig(
        tower=str(path), device=args.device, max_batch=args.max_batch, compile=args.compile
    )
    pipe = EncoderPipeline(cfg, args.hidden)
    base = Baseline(pipe, cfg)
    params = sum(p.numel() for p in base.model.parameters())
    rep.doc["towers"][name] = {
        **shape._asdict(),
        "tokens": shape.tokens,
        "params": params,
        "layers_run_optimized": pipe.tower.num_layers_run,
        "feature_layer": cfg.feature_layer,
        "preprocess": {"resize": pipe.spec.resize, "resample": pipe.spec.resample},
        "build_s": round(time.perf_counter() - t0, 2),
    }
    print(
        f"[tower {name}] {params / 1e6:.1f}M parameters, built in {time.perf_counter() - t0:.1f} s"
    )
    try:
        for what, part in (
            ("preprocess", lambda: bench_preprocess(rep, args, pipe, name)),
            ("tflops", lambda: bench_tower_flops(rep, args, pipe, name, shape)),
            ("throughput", lambda: bench_throughput(rep, args, pipe, base, name, shape)),
        ):
            _part(rep, f"{what} {name}", part)
    finally:
        pipe.close()


def _part(rep: Report, what: str, fn: Callable[[], None]) -> None:
    """Run one part; a failure is recorded (and fails the run) but the other parts still run."""
    t0 = time.perf_counter()
    try:
        fn()
        print(f"[{what}] done in {time.perf_counter() - t0:.1f} s", flush=True)
    except Exception as exc:  # recorded in gpu.json, reported by the exit status
        traceback.print_exc()
        rep.failed.append(f"{what}: {type(exc).__name__}: {exc}")
        rep.doc.setdefault("errors", []).append(rep.failed[-1])
    rep.save()


# -- machine, entry point -----------------------------------------------------------------------


def _machine(device: torch.device) -> dict:
    info = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["capability"] = f"{props.major}.{props.minor}"
        info["memory_gib"] = round(props.total_memory / 2**30, 1)
        info["multiprocessors"] = props.multi_processor_count
    return info


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one round (CI, CPU)")
    ap.add_argument(
        "--peak-tflops", type=float, default=790.0, help="dense bf16 peak (H200 class: 790)"
    )
    ap.add_argument("--peak-gbps", type=float, default=4300.0, help="memory bandwidth peak")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument(
        "--tower",
        action="append",
        default=[],
        choices=(*TOWERS, *QUICK_TOWERS),
        help="only this tower, repeatable (default: both of the run's; quick: the tiny ones)",
    )
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (default 3; quick 1)")
    ap.add_argument("--max-batch", type=int, default=EncoderConfig().max_batch)
    ap.add_argument("--hidden", type=int, default=576, help="language model hidden size")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the optimized tower (CUDA graphs over fixed-shape batches; "
        "adds minutes of compiling)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="stop starting new parts after this many seconds (0: no limit); "
        "what is left is recorded as skipped",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available")
    device = torch.device("cuda" if want_cuda else "cpu")
    args.device = device.type
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.warmup = 0 if args.quick else 1  # quick: a smoke run, first-call costs included
    args.init_device = device
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    machine = _machine(device)
    args.device_name = machine["device_name"]
    args.cpu_name = f"cpu ({machine['cpu']}, {machine['threads']} threads)"
    args.no_cuda = "needs CUDA; this run is on the CPU"
    start = time.monotonic()
    args.budget_reason = f"time budget (--budget-s {args.budget_s:g}) spent before this part"
    args.over_budget = lambda: args.budget_s > 0 and time.monotonic() - start > args.budget_s
    towers = QUICK_TOWERS if args.quick else TOWERS
    if args.tower:
        unknown = sorted(set(args.tower) - set(towers))
        if unknown:
            ap.error(f"--tower {unknown}: this run has {sorted(towers)}")
        towers = {k: v for k, v in towers.items() if k in args.tower}
    settings = {
        "quick": args.quick,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "batches": list(BATCHES),
        "max_batch": args.max_batch,
        "compile": args.compile,
        "hidden_size": args.hidden,
        "peak_tflops": args.peak_tflops,
        "peak_gbps": args.peak_gbps,
        "budget_s": args.budget_s,
        "towers": list(towers),
    }
    rep = Report(args.out / "gpu.json", machine, settings)
    print(
        f"gpu bench on {machine['device_name']} ({device}), torch {machine['torch']}, "
        f"triton {machine['triton']}, {'quick' if args.quick else 'real shapes'}",
        flush=True,
    )
    _part(rep, "int4", lambda: bench_int4(rep, args, device))
    with tempfile.TemporaryDirectory(prefix="vg-gpu-bench-") as tmp:
        for name, shape in towers.items():
            if args.over_budget():
                print(f"[tower {name}] skipped: {args.budget_reason}", flush=True)
                rep.skip_missing(expected_figures({name: shape}), args.budget_reason)
                continue
            _part(
                rep,
                f"tower {name}",
                lambda n=name, s=shape: bench_tower(rep, args, n, s, Path(tmp)),
            )
            shutil.rmtree(Path(tmp) / name, ignore_errors=True)  # GBs at real shapes
            if device.type == "cuda":
                torch.cuda.empty_cache()
    # a part that failed leaves its figures unmeasured: say so rather than leave them out
    rep.skip_missing(expected_figures(towers), "not measured: a part failed (see errors)")
    rep.save()
    plot(rep.doc, args.out / "gpu.png")
    print(f"\nwrote {rep.path} and {args.out / 'gpu.png'} in {rep.doc['elapsed_s']:.1f} s")
    for err in rep.failed:
        print(f"FAILED {err}", file=sys.stderr)
    return 1 if rep.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
