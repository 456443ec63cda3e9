"""Structured-output benchmark: decoding speed with and without a grammar, in one run.

    python -m bench.structured --out DIR [--tokens 16] [--rounds 3] [--batches 1,8]

One `LocalEngine` (the embedded SmolLM2 unless `--model`) answers the same prompts twice per
round: unconstrained, and constrained by a JSON-schema grammar (llguidance, `%json`) whose long
`minLength` string keeps every answer going to the token limit, so both modes decode the same
number of tokens per sequence. A batch of B runs B requests at once. The two runs of a round
are back to back (which goes first alternates), so machine noise hits both alike; one short
run of each mode warms up first and is dropped.

Per mode and batch size: tokens/s (output tokens of the batch over its wall time, prefill
included, which is the same in both modes) and ms per token (each sequence's decode time over
its tokens after the first: the pace of its stream), medians over rounds. The overhead per
token is the median over rounds of grammar over plain ms per token (goal: at most 1.10).

On a busy machine those ratios carry the noise of two forward passes; the grammar's own work
is small beside it. So the grammar answers are also replayed through the engine's mask code
alone (`GrammarMasks`: the masks of B matchers, their application to B logits rows, the
tokens consumed), with no forward to hide behind: `grammar_ms_per_step` is what a step pays at
most for its grammars, and `overhead_bound` is 1 + that over plain ms per token.
Writes DIR/structured.json and DIR/structured.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

__all__ = ("main", "parse_args")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "biography": {"type": "string", "minLength": 2000},
    },
    "required": ["name", "age", "biography"],
    "additionalProperties": False,
}
GRAMMAR = "start: %json " + json.dumps(SCHEMA)
SUBJECTS = (
    "a lighthouse keeper",
    "a retired astronaut",
    "a baker in Lyon",
    "a marine biologist",
    "a chess prodigy",
    "a beekeeper",
    "a train driver",
    "a jazz pianist",
)
OVERHEAD_GOAL = 1.10


def prompt(i: int) -> str:
    return (
        f"Invent {SUBJECTS[i % len(SUBJECTS)]} and write a long, detailed biography of them "
        "as a JSON object with their name, age and biography."
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__)
    ap.add_argument("--out", type=Path, required=True, help="directory for the JSON and table")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2)")
    ap.add_argument("--tokens", type=int, default=16, help="output tokens per answer")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per batch size")
    ap.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    args = ap.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        ap.error("--batches takes integers, e.g. 1,8")
    if not args.batches or min(args.batches) < 1 or args.tokens < 2 or args.rounds < 1:
        ap.error("--batches must be >= 1, --tokens >= 2 and --rounds >= 1")
    return args


async def run_batch(
    engine: Any, batch: int, *, grammar: str | None, tokens: int, temperature: float, tag: str
) -> dict[str, Any]:
    """B requests at once; their tokens, finish reasons and per-token pace."""
    from gateway.engine.interface import (
        GenerationRequest,
        GenerationResult,
        Message,
        SamplingParams,
    )

    async def one(i: int) -> GenerationResult:
        request = GenerationRequest(
            f"structured-{tag}-{i}",
            [Message("user", [prompt(i)])],
            SamplingParams(
                max_output_tokens=tokens, temperature=temperature, seed=i, grammar=grammar
            ),
            cache_salt=f"bench-{tag}-{i}",  # no prefix reuse across rounds: same work each time
        )
        result = None
        async for item in engine.generate(request):
            if isinstance(item, GenerationResult):
                result = item
        assert result is not None
        return result

    started = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(batch)))
    wall = time.perf_counter() - started
    out = sum(r.output_tokens for r in results)
    paces = [r.decode_ms / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
    return {
        "wall_s": wall,
        "output_tokens": out,
        "tokens_per_s": out / wall,
        "ms_per_token": statistics.mean(paces) if paces else None,
        "finish_reasons": sorted({r.finish_reason for r in results}),
        "texts": [r.text for r in results],
    }


def replay_grammar(tokenizer: Any, texts: list[str], batch: int) -> float:
    """Median ms per step of the grammar work for `batch` sequences writing `texts` (their
    tokens consumed in step), without a forward pass to overlap with."""
    import torch

    from gateway.engine.local.grammar import GrammarMasks, TokenVocab, compile_grammar

    vocab = TokenVocab(tokenizer, [tokenizer.eos_token_id])
    answers = [
        tokenizer(texts[i % len(texts)], add_special_tokens=False)["input_ids"]
        for i in range(batch)
    ]
    matchers = [compile_grammar(vocab, GRAMMAR) for _ in range(batch)]
    masks = GrammarMasks(vocab)
    logits = torch.randn(batch, vocab.size)
    steps = []
    try:
        for step in range(min(len(a) for a in answers)):
            started = time.perf_counter()
            masks.start(matchers)
            masks.apply(logits, list(range(batch)))
            for matcher, answer in zip(matchers, answers, strict=True):
                matcher.consume_token(answer[step])
            steps.append((time.perf_counter() - started) * 1e3)
    finally:
        masks.close()
    return statistics.median(steps) if steps else 0.0


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians of the rounds of one batch size, and the grammar's overhead per token (the
    median of each round's ratio: the two runs of a round saw the same machine)."""
    row: dict[str, Any] = {}
    for mode, rounds in runs.items():
        paces = [r["ms_per_token"] for r in rounds if r["ms_per_token"] is not None]
        row[mode] = {
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rounds), 2),
            "ms_per_token": round(statistics.median(paces), 3) if paces else None,
            "finish_reasons": sorted({f for r in rounds for f in r["finish_reasons"]}),
        }
    ratios = [
        g["ms_per_token"] / p["ms_per_token"]
        for p, g in zip(runs["plain"], runs["grammar"], strict=True)
        if p["ms_per_token"] and g["ms_per_token"] is not None
    ]
    row["overhead_per_token"] = round(statistics.median(ratios), 3) if ratios else None
    row["overhead_per_round"] = [round(r, 3) for r in ratios]
    row["goal"] = OVERHEAD_GOAL
    return row


def table(report: dict[str, Any]) -> str:
    lines = [
        "| batch | plain tokens/s | grammar tokens/s | plain ms/token | grammar ms/token "
        "| overhead per token | grammar work ms/step | overhead bound |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch, row in report["batches"].items():
        p, g = row["plain"], row["grammar"]
        lines.append(
            f"| {batch} | {p['tokens_per_s']:.1f} | {g['tokens_per_s']:.1f} "
            f"| {p['ms_per_token']} | {g['ms_per_token']} | {row['overhead_per_token']}x "
            f"| {row['grammar_ms_per_step']} | {row['overhead_bound']}x |"
        )
    return "\n".join(lines) + "\n"


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from gateway.engine.local.local_engine import LocalEngine

    top = max(args.batches)
    engine = LocalEngine(
        args.model, max_batch=max(top, 1), max_queue=max(4 * top, 8), max_queue_per_key=4 * top
    )
    await engine.start()
    report: dict[str, Any] = {
        "model": engine.model_id,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "temperature": args.temperature,
        "grammar": GRAMMAR,
        "batches": {},
    }
    modes = (("plain", None), ("grammar", GRAMMAR))
    try:
        for mode, grammar in modes:  # first compiles, first allocations: not measured
            await run_batch(
                engine, top, grammar=grammar, tokens=4, temperature=0.0, tag=f"warm-{mode}"
            )
        steps = len(args.batches) * args.rounds * 2
        with tqdm(total=steps, desc="structured", unit="run", file=sys.stderr) as bar:
            for batch in args.batches:
                runs: dict[str, list[dict[str, Any]]] = {"plain": [], "grammar": []}
                for rnd in range(args.rounds):
                    for mode, grammar in modes if rnd % 2 == 0 else modes[::-1]:
                        bar.set_postfix(batch=batch, mode=mode, round=rnd)
                        run = await run_batch(
                            engine,
                            batch,
                            grammar=grammar,
                            tokens=args.tokens,
                            temperature=args.temperature,
                            tag=f"{batch}-{rnd}-{mode}",
                        )
                        runs[mode].append(run)
                        bar.update()
                row = summarize(runs)
                texts = [t for r in runs["grammar"] for t in r["texts"]]
                work = replay_grammar(engine.tokenizer, texts, batch)
                row["grammar_ms_per_step"] = round(work, 3)
                plain = row["plain"]["ms_per_token"]
                row["overhead_bound"] = round(1 + work / plain, 3) if plain else None
                row["sample_answer"] = runs["grammar"][-1]["texts"][0]
                report["batches"][str(batch)] = row
    finally:
        await engine.aclose()
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from gateway.telemetry import configure_logging

    configure_logging("warning")
    args.out.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(measure(args))
    (args.out / "structured.json").write_text(json.dumps(report, indent=2))
    text = table(report)
    (args.out / "structured.md").write_text(text)
    print(f"\n{report['model']}, {args.tokens} tokens per answer, median of {args.rounds} rounds")
    print(text)
    print(f"goal: grammar overhead per token <= {OVERHEAD_GOAL}x")
    print(f"wrote {args.out / 'structured.json'} and {args.out / 'structured.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
