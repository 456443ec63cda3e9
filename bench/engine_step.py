"""Where a decode step's time goes: the modules' step against the fused step, in one process.

    python -m bench.engine_step                # ~3 min on a 2-core CPU

On the embedded default model, one intra-op thread (as the gateway gives its engine on a
2-core machine), `SeqKV` buffers holding 100 positions, 1 and 8 decoding sequences:

- CPU time of one step (`time.thread_time`, so other processes' load counts less than in wall
  time), the paths interleaved three times and the best kept: the modules' float32 step
  (`batch.run_step`, the exact mode) and the fused step in float32, float16 (`auto` on a CPU),
  bfloat16 and int8;
- `torch.profiler` over 5 steps of the modules' float32 step and the fused float16 and int8
  steps: operator calls per step and the share of operator time in matrix products and in
  attention.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

CONTEXT = 100
PRECISIONS = ("float32", "float16", "bfloat16", "int8")
_MATMUL = (
    "aten::mm",
    "aten::addmm",
    "aten::_weight_int8pack_mm",
    "aten::bmm",
    "quantized::linear_dynamic_fp16",
)
_ATTENTION = (
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_attention_math",
)


def _buffers(w: Any, n: int, dtype: torch.dtype) -> list[Any]:
    from gateway.engine.local.batch import SeqKV

    cfg = w.model.config.get_text_config()
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        kv = SeqKV(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 256, dtype, w.device
        )
        for t in kv.layers:
            t.copy_(torch.randn(t.shape, generator=g))
        kv.length = CONTEXT
        out.append(kv)
    return out


def _steps(w: Any, fn: Any, dtype: torch.dtype, streams: int, n: int) -> float:
    """CPU seconds per step of `n` decode steps over `streams` sequences."""
    from gateway.engine.local.batch import Slice

    bufs = _buffers(w, streams, dtype)
    row = w.embed(torch.tensor([5])).to(dtype)  # [1, H]
    started = time.thread_time()
    for _ in range(n):
        slices = [Slice(kv, CONTEXT, 1, row, torch.tensor([CONTEXT]), True) for kv in bufs]
        [int(r.argmax()) for r in fn(slices)]
    return (time.thread_time() - started) / n


def _profile(w: Any, fn: Any, dtype: torch.dtype, streams: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    _steps(w, fn, dtype, streams, 2)
    bufs_steps = 5
    with profile(activities=[ProfilerActivity.CPU]) as p:
        _steps(w, fn, dtype, streams, bufs_steps)
    events = [e for e in p.key_averages() if e.key not in ("aten::randn", "aten::copy_")]
    total = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if e.key in _MATMUL)
    attention = sum(e.self_cpu_time_total for e in events if e.key in _ATTENTION)
    return {
        "op_calls": round(sum(e.count for e in events) / bufs_steps),
        "matmul_calls": round(sum(e.count for e in events if e.key in _MATMUL) / bufs_steps),
        "matmul_share": round(matmul / total, 3),
        "attention_share": round(attention / total, 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from gateway.engine.local.batch import cache_param, install_attention, run_step
    from gateway.engine.local.fused_step import FusedDecoder
    from gateway.engine.local.weights import load_weights

    ap = argparse.ArgumentParser(prog="python -m bench.engine_step", description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    w = load_weights(device="cpu", dtype="float32")
    install_attention(w.model)
    cfg = w.model.config.get_text_config()
    arg = cache_param(w.decoder)

    def modules(slices: Any) -> torch.Tensor:
        return run_step(w.decoder, w.lm_head, slices, mrope=False, cache_arg=arg)

    paths: dict[str, tuple[Any, torch.dtype]] = {"modules, float32": (modules, torch.float32)}
    for p in PRECISIONS:
        fused = FusedDecoder(w.decoder, w.lm_head, cfg, p)
        paths[f"fused, {p}"] = (fused.run, fused.dtype)
    times: dict[str, dict[int, float]] = {name: {} for name in paths}
    profiles: dict[str, dict[int, Any]] = {}
    with torch.inference_mode():
        for streams in (1, 8):
            for _ in range(args.rounds):
                for name, (fn, dtype) in paths.items():
                    t = _steps(w, fn, dtype, streams, 8 if streams == 1 else 4)
                    times[name][streams] = min(times[name].get(streams, t), t)
            for name in ("modules, float32", "fused, float16", "fused, int8"):
                fn, dtype = paths[name]
                profiles.setdefault(name, {})[streams] = _profile(w, fn, dtype, streams)
    print(f"{'step':18s} {'1 stream ms':>12s} {'8 streams ms':>13s}")
    for name, t in times.items():
        print(f"{name:18s} {t[1] * 1000:12.1f} {t[8] * 1000:13.1f}")
    print()
    for name, by in profiles.items():
        for streams, p in by.items():
            print(f"{name:18s} {streams} stream(s): {p}")
    return {"step_s": times, "profiles": profiles}


if __name__ == "__main__":
    main()
