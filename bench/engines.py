"""Engines benchmark: the embedded engine beside a real vLLM on the same model, in one run.

    python -m bench.engines --out bench/out         # ~15 min on a 2-core CPU; engines.json
    python -m bench.engines --quick                 # one precision each, fewer tokens

The same converted SmolLM2-135M-Instruct checkpoint (`gateway.testing.vllm_server.
default_model_dir`) is served, one server at a time, by:

- visiongate (`python -m gateway serve`, the embedded engine) at each precision it offers:
  `auto` (its default: `float16` on a CPU with fbgemm, for the default model), `float32` (the
  exact mode), `float16`, `bfloat16`, `int8`;
- vLLM (`VllmServer`, from its own venv, `make vllm-env`) at its default dtype and at float32
  (skipped, and said so, when the venv is missing).

The client is the official `openai` SDK, streaming chat completions, greedy, `--tokens` output
tokens (64): `--singles` (3) prompts one after another, then 8 at once. Per server: output
tokens/s of one stream (mean over the singles) and of 8 streams (all tokens over the wall time),
TTFT P50/P95 (first content delta) of each phase, and the ratios of visiongate's default to
vLLM's default and of each precision to the same precision on vLLM where both run it.

The machine's memory bandwidth is measured first (torch reading a 256 MiB tensor, the best of
several passes, with 1 and with all threads), and the floor of one decode stream per precision
printed: bandwidth / bytes of weights read per token (every matrix once, the tied output head
included; int8 at 1 byte a weight, float16 and bfloat16 at 2, float32 at 4).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

PROMPTS = (
    "Write a short story about a lighthouse keeper and a storm.",
    "Explain how rain forms, in a few paragraphs.",
    "Describe a busy market in the morning, in detail.",
    "Tell me about the history of the bicycle.",
    "Write a letter to a friend about a trip to the mountains.",
    "Explain why the sky is blue to a curious child.",
    "Describe how bread is made, step by step.",
    "Write a short poem about the sea, then explain it.",
)
VISIONGATE_PRECISIONS = ("auto", "float32", "float16", "bfloat16", "int8")
BYTES_PER_WEIGHT = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


def memory_bandwidth() -> dict[str, float]:
    """GB/s read by torch summing a 256 MiB float32 tensor, best pass, per thread count."""
    import torch

    before = torch.get_num_threads()
    out = {}
    a = torch.ones(64 << 20)  # 256 MiB
    try:
        for threads in sorted({1, os.cpu_count() or 1}):
            torch.set_num_threads(threads)
            a.sum()
            best = min(_timed(a.sum) for _ in range(8))
            out[f"threads_{threads}"] = round(a.numel() * 4 / best / 1e9, 2)
    finally:
        torch.set_num_threads(before)
    return out


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weights_read_per_token(model_dir: Path) -> int:
    """Weights one decode step reads: every stored tensor once (a tied head is stored once)."""
    from safetensors import safe_open

    n = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safetensors handle
                shape = f.get_slice(key).get_shape()
                size = 1
                for d in shape:
                    size *= d
                n += size
    return n


def auto_precision(model_dir: Path) -> str:
    """What the gateway's `auto` weights are on this CPU for the model at `model_dir`."""
    import torch
    from transformers import AutoConfig

    from gateway.engine.local.fused_step import supported
    from gateway.engine.local.weights import _pick_weights

    fusable = supported(AutoConfig.from_pretrained(model_dir).get_text_config()) is None
    return _pick_weights("auto", torch.device("cpu"), fusable=fusable)


async def _stream(client: Any, model: str, prompt: str, tokens: int) -> dict[str, float]:
    started = time.perf_counter()
    first = None
    out = 0
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            out = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {"ttft_ms": ((first or end) - started) * 1000, "tokens": out, "seconds": end - started}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def measure(base_url: str, tokens: int, singles: int, streams: int) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    try:
        model = (await client.models.list()).data[0].id
        await _stream(client, model, "Hi", 4)  # warm-up
        one = [
            await _stream(client, model, PROMPTS[i % len(PROMPTS)], tokens) for i in range(singles)
        ]
        started = time.perf_counter()
        many = await asyncio.gather(
            *(_stream(client, model, PROMPTS[i % len(PROMPTS)], tokens) for i in range(streams))
        )
        wall = time.perf_counter() - started
    finally:
        await client.close()
    return {
        "model": model,
        "tok_s_1": statistics.mean(r["tokens"] / r["seconds"] for r in one),
        "ttft_p50_1": _pct([r["ttft_ms"] for r in one], 0.5),
        "ttft_p95_1": _pct([r["ttft_ms"] for r in one], 0.95),
        f"tok_s_{streams}": sum(r["tokens"] for r in many) / wall,
        f"ttft_p50_{streams}": _pct([r["ttft_ms"] for r in many], 0.5),
        f"ttft_p95_{streams}": _pct([r["ttft_ms"] for r in many], 0.95),
        "tokens_1": [r["tokens"] for r in one],
        f"tokens_{streams}": [r["tokens"] for r in many],
    }


def run_visiongate(precision: str, args: argparse.Namespace) -> dict[str, Any]:
    from bench._load_server import GatewayProcess

    proc = GatewayProcess(
        f"visiongate-{precision}",
        {"lm_dtype": precision, "engine_max_batch": max(args.streams, 8)},
        args.out / f"visiongate-{precision}.log",
    ).start()
    try:
        proc.wait_ready(600)
        return asyncio.run(measure(proc.http_url + "/v1", args.tokens, args.singles, args.streams))
    finally:
        proc.stop()


def run_vllm(dtype: str | None, args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    from gateway.testing.vllm_server import VllmServer

    with VllmServer(
        model_dir, dtype=dtype, max_model_len=2048, log_dir=args.out, name=f"vllm-{dtype}"
    ) as server:
        result = asyncio.run(measure(server.base_url, args.tokens, args.singles, args.streams))
        # the dtype vLLM chose, as its engine config line logs it
        found = re.search(r"dtype=torch\.(\w+)", server.log_path.read_text(errors="replace"))
        result["precision"] = found.group(1) if found else (dtype or "unknown")
        return result


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def table(report: dict[str, Any], streams: int) -> str:
    lines = [
        f"memory bandwidth (GB/s): {report['bandwidth_gb_s']}; "
        f"weights read per token: {report['weights_per_token'] / 1e6:.1f} M",
        "floor of one decode stream (tok/s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in report["floor_tok_s"].items()),
        "",
        f"{'server':24s} {'1 stream tok/s':>14s} {'TTFT p50':>9s} {'p95':>7s} "
        f"{f'{streams} streams tok/s':>16s} {'TTFT p50':>9s} {'p95':>7s} {'1-stream % floor':>16s}",
    ]
    for name, r in report["servers"].items():
        if "error" in r:
            lines.append(f"{name:24s} {r['error']}")
            continue
        floor = r.get("floor_share")
        lines.append(
            f"{name:24s} {r['tok_s_1']:14.1f} {r['ttft_p50_1']:9.0f} {r['ttft_p95_1']:7.0f} "
            f"{r[f'tok_s_{streams}']:16.1f} {r[f'ttft_p50_{streams}']:9.0f} "
            f"{r[f'ttft_p95_{streams}']:7.0f} {'' if floor is None else f'{floor:15.0%}'}"
        )
    if report["ratios"]:
        lines.append("")
        for name, value in report["ratios"].items():
            lines.append(f"{name}: {value}")
    return "\n".join(lines)


def ratios(servers: dict[str, Any], streams: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pairs = [("visiongate auto", "vllm default")]
    pairs += [(f"visiongate {p}", f"vllm {p}") for p in ("float32", "bfloat16")]
    for a, b in pairs:
        ra, rb = servers.get(a, {}), servers.get(b, {})
        if "tok_s_1" in ra and "tok_s_1" in rb:
            out[f"{a} / {b}"] = {
                "tok_s_1": _ratio(ra["tok_s_1"], rb["tok_s_1"]),
                f"tok_s_{streams}": _ratio(ra[f"tok_s_{streams}"], rb[f"tok_s_{streams}"]),
                f"ttft_p95_{streams}": _ratio(ra[f"ttft_p95_{streams}"], rb[f"ttft_p95_{streams}"]),
            }
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.engines", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--singles", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--precisions", default=",".join(VISIONGATE_PRECISIONS))
    ap.add_argument("--vllm-dtypes", default="default,float32", help="'default': vLLM's choice")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--quick", action="store_true", help="auto and int8 vs vLLM's default")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from gateway.testing.vllm_server import default_model_dir, vllm_missing

    args = parse_args(argv)
    if args.quick:
        args.precisions, args.vllm_dtypes, args.tokens, args.singles = "auto,int8", "default", 32, 2
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = default_model_dir()
    bandwidth = memory_bandwidth()
    weights = weights_read_per_token(model_dir)
    best = max(bandwidth.values())
    floor = {p: best * 1e9 / (weights * b) for p, b in BYTES_PER_WEIGHT.items()}
    servers: dict[str, Any] = {}
    effective = {"auto": auto_precision(model_dir)}  # what `auto` is here for this model
    for precision in [p for p in args.precisions.split(",") if p]:
        name = f"visiongate {precision}"
        try:
            servers[name] = run_visiongate(precision, args)
        except Exception as exc:  # one server failing leaves the others' numbers
            servers[name] = {"error": f"{type(exc).__name__}: {exc}"}
        servers[name]["precision"] = effective.get(precision, precision)
    missing = "skipped (--no-vllm)" if args.no_vllm else vllm_missing()
    for dtype in [d for d in args.vllm_dtypes.split(",") if d]:
        name = f"vllm {dtype}"
        if missing is not None:
            servers[name] = {"error": missing}
            continue
        try:
            servers[name] = run_vllm(None if dtype == "default" else dtype, args, model_dir)
        except Exception as exc:
            servers[name] = {"error": f"{type(exc).__name__}: {exc}"}
    for r in servers.values():
        if "tok_s_1" in r and r.get("precision") in floor:
            r["floor_share"] = round(r["tok_s_1"] / floor[r["precision"]], 3)
    report = {
        "bandwidth_gb_s": bandwidth,
        "weights_per_token": weights,
        "floor_tok_s": {k: round(v, 1) for k, v in floor.items()},
        "tokens": args.tokens,
        "singles": args.singles,
        "streams": args.streams,
        "servers": servers,
        "ratios": ratios(servers, args.streams),
    }
    print(table(report, args.streams))
    (args.out / "engines.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
