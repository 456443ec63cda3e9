"""Benchmark: what freezing the heap saves a request that allocates many objects.

    python -m bench.gc_freeze --out DIR              # beside the embedded engine (loads it)
    python -m bench.gc_freeze --out DIR --no-model   # beside the gateway's modules only

`visiongate serve` calls `gc.freeze()` once its models are loaded (gateway/server/app.py): what is
alive
then lives as long as the process, and the cyclic collector's passes stop walking it. A request
body of many small JSON values allocates one object per value, and every few hundred
allocations the collector runs; its older generations walk the whole heap. In one process, with
a gateway's heap loaded (its app and engine, or its modules alone), this decodes a JSON body of
`--values` empty lists (what msgspec does for a request body) with the heap as it is and with it
frozen, alternating over `--rounds` rounds, and prints the median time of each and their ratio;
DIR/gc_freeze.json keeps every round.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog

from bench._load_report import machine_info
from bench._load_stats import write_json

__all__ = ("main", "parse_args", "tiny_values_body")

log = structlog.get_logger("bench.gc_freeze")


def tiny_values_body(values: int) -> bytes:
    """A chat request whose tool schema holds `values` empty JSON lists."""
    lists = ",".join(["[]"] * values)
    return (
        '{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function",'
        f'"function":{{"name":"f","parameters":{{"type":"object","x":[{lists}]}}}}}}]}}'
    ).encode()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/out", help="output directory (default bench/out)")
    p.add_argument("--values", type=int, default=160_000, help="empty lists in the body")
    p.add_argument("--rounds", type=int, default=5, help="rounds of both (default 5)")
    p.add_argument("--repeats", type=int, default=5, help="decodes per timing (default 5)")
    p.add_argument("--no-model", action="store_true", help="do not load the embedded engine")
    args = p.parse_args(argv)
    if args.values < 1 or args.rounds < 1 or args.repeats < 1:
        p.error("--values, --rounds and --repeats must be >= 1")
    return args


def _decode_ms(body: bytes, repeats: int) -> float:
    decode = msgspec.json.decode
    t0 = time.perf_counter()
    for _ in range(repeats):
        decode(body)
    return (time.perf_counter() - t0) * 1e3 / repeats


def _load_heap(load_model: bool) -> Any:
    from gateway.server.app import create_app
    from gateway.settings import Settings

    settings = Settings.load({}, environ={})
    if not load_model:
        from gateway.testing.fakes import FakeEncoder, FakeEngine

        return create_app(settings, engine=FakeEngine(), encoder=FakeEncoder())
    from gateway.engine import LocalEngine

    engine = LocalEngine()
    asyncio.run(engine.start())
    return create_app(settings, engine=engine), engine


def measure(body: bytes, rounds: int, repeats: int) -> list[dict[str, float]]:
    """Per round: ms per decode with the heap as it is, then frozen."""
    out = []
    for r in range(rounds):
        gc.unfreeze()
        gc.collect()
        live = _decode_ms(body, repeats)
        gc.collect()
        gc.freeze()
        frozen = _decode_ms(body, repeats)
        gc.unfreeze()
        out.append({"live_ms": live, "frozen_ms": frozen, "ratio": live / frozen})
        log.info("round", round=r + 1, live_ms=round(live, 1), frozen_ms=round(frozen, 1))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:  # tests/ (the fakes) is not an installed package
        sys.path.insert(0, str(root))
    log.info("loading", model=not args.no_model)
    held = _load_heap(not args.no_model)  # kept alive: it is the heap being measured
    objects = len(gc.get_objects())
    body = tiny_values_body(args.values)
    log.info("measuring", heap_objects=objects, body_bytes=len(body), rounds=args.rounds)
    rounds = measure(body, args.rounds, args.repeats)
    live = statistics.median(r["live_ms"] for r in rounds)
    frozen = statistics.median(r["frozen_ms"] for r in rounds)
    ratio = statistics.median(r["ratio"] for r in rounds)
    print(
        f"heap: {objects} objects ({'embedded engine' if not args.no_model else 'modules only'}); "
        f"body: {len(body)} bytes, {args.values} empty lists\n"
        f"ms per decode, median of {args.rounds} rounds:  heap live {live:8.1f}   "
        f"heap frozen {frozen:8.1f}   live/frozen {ratio:5.2f}x"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "gc_freeze",
        "args": vars(args),
        "machine": machine_info(),
        "heap_objects": objects,
        "body_bytes": len(body),
        "rounds": rounds,
        "median": {"live_ms": live, "frozen_ms": frozen, "ratio": ratio},
    }
    write_json(out / "gc_freeze.json", report)
    print(f"wrote {out / 'gc_freeze.json'}")
    del held
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
