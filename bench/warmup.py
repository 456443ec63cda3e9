"""KV warm-up benchmark: the first question about a photo, sent ahead or with the question.

Two gateways run in this process on loopback ports, serving the embedded model: `warmup` (the
default: once a photo item is encoded, the conversation through it is prefilled while the user
types) and `no_warmup` (`kv_warmup=False`: the photo is pre-encoded, its prefill waits for the
question). A viewer session measures, per trial, client-side TTFT (response.create sent -> first
delta received) of:

- `photo_ahead`: the photo item sent `--ahead` seconds (3) before the question item;
- `photo_with_question`: photo and question in one item (encode and prefill both on the path);
- `text_followup`: the same session's next, text-only question of about the same length.

Each runs alone and beside `--load` (8) concurrent sessions that keep asking text questions;
their inter-token gaps give the other sessions' decode P95 in each phase. Every trial uses a
photo of its own (a pixel changed), so no trial reuses another's KV or visual tokens.

    python -m bench.warmup --out bench/out          # writes warmup.json
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import time
from pathlib import Path
from typing import Any

INSTRUCTIONS = "You are a helpful assistant who describes photos."
QUESTION = "What is in this photo? Answer briefly."
FOLLOW_UP = "What colours stand out? Answer briefly."  # about as many tokens as QUESTION
LOAD_QUESTIONS = (
    "Tell me a short story about a lighthouse keeper.",
    "Explain how rain forms, in a few sentences.",
    "List some facts about the moon.",
    "Describe a busy market in the morning.",
)
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket")
CONDITIONS = ("photo_ahead", "photo_with_question", "text_followup")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench/out", help="output directory")
    parser.add_argument("--trials", type=int, default=3, help="viewer trials per phase (3)")
    parser.add_argument("--load", type=int, default=8, help="concurrent other sessions (8)")
    parser.add_argument("--ahead", type=float, default=3.0, help="seconds the photo leads (3)")
    parser.add_argument("--max-tokens", type=int, default=16, help="per viewer answer (16)")
    parser.add_argument("--load-tokens", type=int, default=48, help="per load answer (48)")
    parser.add_argument(
        "--quick", action="store_true", help="one trial, 2 load sessions, 1 s ahead (smoke run)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.trials, args.load, args.ahead = 1, 2, 1.0
        args.max_tokens, args.load_tokens = 6, 12
    if args.trials < 1 or args.load < 0 or args.ahead < 0 or args.max_tokens < 1:
        parser.error("--trials and --max-tokens must be >= 1, --load and --ahead >= 0")
    return args


def photo(index: int) -> bytes:
    """A sample photo with one pixel set from `index`: bytes (and tokens) of its own."""
    from PIL import Image
    from skimage import data

    img = Image.fromarray(getattr(data, PHOTOS[index % len(PHOTOS)])()).convert("RGB")
    img.putpixel((0, 0), (index * 37 % 256, index * 91 % 256, index * 53 % 256))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=92)
    return buf.getvalue()


async def _timed(client: Any, max_tokens: int) -> tuple[float, Any]:
    """Start a response; (client-side TTFT ms, the result)."""
    t0 = time.perf_counter()
    answer = await client.ask(None, max_output_tokens=max_tokens, temperature=0)
    ttft = None
    async for _ in answer:
        if ttft is None:
            ttft = (time.perf_counter() - t0) * 1e3
    return round(ttft or 0.0, 1), answer.result


def _row(condition: str, ttft: float, r: Any) -> dict[str, Any]:
    usage = r.usage
    return {
        "condition": condition,
        "ttft_ms": ttft,
        "server_ttft_ms": r.timings.get("ttft_ms", 0.0),
        "encode_ms": r.timings.get("encode_ms", 0.0),
        "prefill_ms": r.timings.get("prefill_ms", 0.0),
        "input_tokens": usage.get("input_tokens", 0),
        "prefill_tokens": usage.get("input_tokens", 0) - r.cached_tokens,
        "kv_warmed_tokens": int(r.cache.get("kv_warmed_tokens", 0)),
        "text": r.text,
    }


async def viewer_trial(url: str, index: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One photo sent ahead, its question, a text follow-up; then a photo with its question."""
    from gateway.sdk.client import RealtimeClient, image_data_url

    rows = []
    async with await RealtimeClient.connect(url) as client:
        await client.update_session(instructions=INSTRUCTIONS)
        await client.add_message(
            [{"type": "input_image", "image_url": image_data_url(photo(index))}]
        )
        await asyncio.sleep(args.ahead)  # the user is typing
        await client.add_message([{"type": "input_text", "text": QUESTION}])
        rows.append(_row("photo_ahead", *await _timed(client, args.max_tokens)))
        await client.add_message([{"type": "input_text", "text": FOLLOW_UP}])
        rows.append(_row("text_followup", *await _timed(client, args.max_tokens)))
    async with await RealtimeClient.connect(url) as client:
        await client.update_session(instructions=INSTRUCTIONS)
        parts = [
            {"type": "input_image", "image_url": image_data_url(photo(index + 1000))},
            {"type": "input_text", "text": QUESTION},
        ]
        await client.add_message(parts)
        rows.append(_row("photo_with_question", *await _timed(client, args.max_tokens)))
    for row in rows:
        print(
            f"      {row['condition']:<20} TTFT {row['ttft_ms']:7.1f} ms | prefill "
            f"{row['prefill_tokens']:4d} tokens | warmed {row['kv_warmed_tokens']:4d} | encode "
            f"{row['encode_ms']:6.1f} ms",
            flush=True,
        )
    return rows


async def load_session(url: str, index: int, stop: asyncio.Event, gaps: list[float], tokens: int):
    """Keep asking text questions until `stop`; record the gaps between text deltas."""
    from gateway.sdk.client import RealtimeClient

    async with await RealtimeClient.connect(url) as client:
        turn = 0
        while not stop.is_set():
            question = LOAD_QUESTIONS[(index + turn) % len(LOAD_QUESTIONS)]
            answer = await client.ask(question, max_output_tokens=tokens, temperature=0)
            last = None
            async for _ in answer:
                now = time.perf_counter()
                if last is not None and not stop.is_set():
                    gaps.append((now - last) * 1e3)
                last = now
            turn += 1


async def phase(url: str, load: int, first: int, args: argparse.Namespace) -> dict[str, Any]:
    stop = asyncio.Event()
    gaps: list[float] = []
    others = [
        asyncio.create_task(load_session(url, i, stop, gaps, args.load_tokens)) for i in range(load)
    ]
    try:
        if load:
            await asyncio.sleep(2.0)  # the load is decoding before the first trial
        rows = []
        for t in range(args.trials):
            print(f"    trial {t + 1}/{args.trials}", flush=True)
            rows += await viewer_trial(url, first + 2 * t, args)
    finally:
        stop.set()
        await asyncio.gather(*others, return_exceptions=True)
    return {"rows": rows, "decode_gaps_ms": gaps}


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 1)


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for gateway, phases in results.items():
        for name, ph in phases.items():
            medians = {
                c: round(
                    statistics.median(r["ttft_ms"] for r in ph["rows"] if r["condition"] == c), 1
                )
                for c in CONDITIONS
            }
            text = medians["text_followup"]
            summary[f"{gateway}/{name}"] = {
                "ttft_ms_median": medians,
                # what each first turn prefilled after its question arrived (timing-free)
                "prefill_tokens_median": {
                    c: statistics.median(
                        r["prefill_tokens"] for r in ph["rows"] if r["condition"] == c
                    )
                    for c in CONDITIONS
                },
                "ratio_vs_text_followup": {
                    c: round(medians[c] / text, 3) if text else None for c in CONDITIONS
                },
                "kv_warmed_tokens_median": statistics.median(
                    r["kv_warmed_tokens"] for r in ph["rows"] if r["condition"] == "photo_ahead"
                ),
                "other_sessions_decode_p95_ms": _p95(ph["decode_gaps_ms"]),
                "answers": {
                    c: [r["text"] for r in ph["rows"] if r["condition"] == c] for c in CONDITIONS
                },
            }
    warm = [k for k in summary if k.startswith("warmup/")]
    summary["goal_photo_ahead_vs_text_followup"] = 1.3
    summary["answers_equal_with_and_without_warmup"] = all(
        summary[k]["answers"] == summary[k.replace("warmup/", "no_warmup/")]["answers"]
        for k in warm
    )
    return summary


def start_gateway(**overrides: Any):
    from gateway.server.app import create_app
    from gateway.server.runner import ServerThread
    from gateway.settings import Settings

    settings = Settings.load({"log_level": "warning", **overrides})
    server = ServerThread(create_app(settings), settings).start()
    server.wait_ready()
    return server


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from gateway.telemetry import configure_logging

    configure_logging("warning")
    print("starting two gateways (warmup, no_warmup) ...", flush=True)
    gateways = {"warmup": start_gateway(), "no_warmup": start_gateway(kv_warmup=False)}
    results: dict[str, Any] = {name: {} for name in gateways}
    try:
        # the same photos in the same order on both gateways: their answers must match
        for p, (name, load) in enumerate((("alone", 0), (f"load{args.load}", args.load))):
            if name != "alone" and not args.load:
                continue
            for gateway, server in gateways.items():
                print(f"  {gateway} / {name}", flush=True)
                results[gateway][name] = asyncio.run(
                    phase(server.ws_url, load, 100 * (p + 1), args)
                )
    finally:
        for server in gateways.values():
            server.stop()
    summary = summarize(results)
    report = {
        "benchmark": "warmup",
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "summary": summary,
        "results": results,
    }
    path = out / "warmup.json"
    path.write_text(json.dumps(report, indent=2))

    print("\nfirst-turn TTFT, median ms (ratio to the text-only follow-up)")
    print(f"  {'gateway / phase':<22}" + "".join(f"{c:>28}" for c in CONDITIONS) + "   decode P95")
    for key, s in summary.items():
        if not isinstance(s, dict) or "ttft_ms_median" not in s:
            continue
        cells = "".join(
            f"{s['ttft_ms_median'][c]:>18.0f} ({s['ratio_vs_text_followup'][c]:.2f}x)"
            for c in CONDITIONS
        )
        p95 = s["other_sessions_decode_p95_ms"]
        print(f"  {key:<22}{cells}   {'-' if p95 is None else f'{p95:.0f} ms'}")
    print("prompt tokens prefilled after the question arrived, median")
    for key, s in summary.items():
        if isinstance(s, dict) and "prefill_tokens_median" in s:
            tokens = s["prefill_tokens_median"]
            print(f"  {key:<22}" + "".join(f"{tokens[c]:>28g}" for c in CONDITIONS))
    print(
        f"goal: photo_ahead <= {summary['goal_photo_ahead_vs_text_followup']}x text_followup, "
        "and no worse decode P95 for the other sessions than without warm-up"
    )
    print(
        f"greedy answers identical with and without warm-up: "
        f"{summary['answers_equal_with_and_without_warmup']}"
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
