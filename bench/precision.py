"""Precision benchmark: each precision the embedded engine offers, against float32, on real text.

    python -m bench.precision --out bench/out            # ~5 min on a 2-core CPU; precision.json
    python -m bench.precision --quick                    # a smoke run

For the embedded SmolLM2-135M-Instruct (or `--model-path`), per precision (`float16`, what
`auto` picks on a CPU for a model the fused step takes, `bfloat16`, `int8`; float32 is the
reference, served by the checkpoint's own transformers modules):

- perplexity on a corpus that ships with every CPython: the language reference and library
  topics of `pydoc_data.topics` (the text `help()` shows), its topics in name order, cut into
  `--windows` windows of `--window-tokens` tokens, each scored from its first token on. The text
  is English prose about Python; it was not picked for or tuned on, and it may overlap the
  model's training data, which does not matter for a ratio to float32. Reported: perplexity,
  its ratio to float32's, and how often the precision's most likely next token is float32's
  (teacher-forced top-1 agreement);
- greedy agreement: `--prompts` fixed chat prompts answered by the real `LocalEngine` in that
  precision (greedy, `--tokens` tokens, 8 at once, as they are served) against float32's
  answers: the share answered identically, and the mean share of float32's answer (in
  characters) that the precision's answer repeats before it first differs.

The non-float32 precisions are computed by the step the engine runs for them
(`gateway.engine.local.fused_step`), so the numbers are those of what a user gets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a short story about a fox who finds a lantern.",
    "Explain how rain forms, in a few sentences.",
    "List three facts about the moon.",
    "Describe a busy market in the morning.",
    "How do I reverse a list in Python?",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Write a haiku about winter.",
    "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet.",
    "Explain what a neural network is to a child.",
    "Suggest a name for a bakery and explain why.",
    "What should I pack for a weekend hiking trip?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Describe the water cycle step by step.",
)
PRECISIONS = ("float16", "bfloat16", "int8")


def corpus_text() -> str:
    """The `pydoc_data.topics` texts, topics in name order (shipped with CPython)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def corpus_windows(tokenizer: Any, windows: int, length: int) -> list[list[int]]:
    ids = tokenizer(corpus_text(), add_special_tokens=False)["input_ids"]
    n = min(windows, len(ids) // length)
    return [ids[i * length : (i + 1) * length] for i in range(n)]


def _scores(logits: Any, ids: list[int]) -> tuple[float, list[int]]:
    """Summed negative log-likelihood of ids[1:] under logits[:-1]; the argmax row ids."""
    import torch

    target = torch.tensor(ids[1:])
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    nll = -lp.gather(1, target[:, None]).sum().item()
    return nll, logits[:-1].argmax(dim=-1).tolist()


def perplexities(
    model_path: str | None, windows: int, length: int, precisions: tuple[str, ...]
) -> dict[str, dict[str, float]]:
    """Perplexity and top-1 agreement with float32, per precision, on the corpus windows."""
    import torch

    from gateway.engine.local.batch import SeqKV, Slice
    from gateway.engine.local.weights import load_weights

    torch.set_grad_enabled(False)
    ref = load_weights(model_path, device="cpu", dtype="float32")
    texts = corpus_windows(ref.tokenizer, windows, length)
    reference: list[list[int]] = []
    nll = 0.0
    for ids in texts:  # the exact path: the checkpoint's own modules, sdpa attention
        logits = ref.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        total, top = _scores(logits, ids)
        nll += total
        reference.append(top)
    scored = sum(len(ids) - 1 for ids in texts)
    out = {"float32": {"perplexity": math.exp(nll / scored), "top1_agreement": 1.0}}
    cfg = ref.model.config.get_text_config()
    for precision in precisions:
        w = load_weights(model_path, device="cpu", dtype=precision)
        if w.fused is None:
            raise SystemExit(f"{precision}: this model runs on the transformers path here")
        nll, same = 0.0, 0
        kv_heads = int(cfg.num_key_value_heads or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        for ids, top_ref in zip(texts, reference, strict=True):
            kv = SeqKV(int(cfg.num_hidden_layers), kv_heads, head_dim, length, w.dtype, w.device)
            t = torch.tensor(ids)
            sl = Slice(kv, 0, len(ids), w.embed(t).to(w.dtype), torch.arange(len(ids)), True)
            logits = w.fused.run([sl], every_row=True)
            total, top = _scores(logits, ids)
            nll += total
            same += sum(a == b for a, b in zip(top, top_ref, strict=True))
        ppl = math.exp(nll / scored)
        out[precision] = {
            "perplexity": ppl,
            "top1_agreement": same / scored,
        }
    for row in out.values():
        row["ratio"] = row["perplexity"] / out["float32"]["perplexity"]
    out["_corpus"] = {"windows": len(texts), "corpus_tokens": scored + len(texts)}  # type: ignore[assignment]
    return out


async def _answers(
    model_path: str | None, precision: str, prompts: tuple[str, ...], tokens: int
) -> list[str]:
    from gateway.engine.interface import GenerationRequest, Message, SamplingParams
    from gateway.engine.local.local_engine import LocalEngine
    from gateway.testing.engine_requests import drain

    engine = LocalEngine(model_path=model_path, device="cpu", dtype=precision, max_batch=8)
    await engine.start()
    try:
        sem = asyncio.Semaphore(8)

        async def one(i: int, prompt: str) -> str:
            req = GenerationRequest(
                f"precision-{i}",
                [Message("user", [prompt])],
                SamplingParams(max_output_tokens=tokens, temperature=0.0),
            )
            async with sem:
                _, results = await drain(engine, req)
            return results[-1].text

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await engine.aclose()


def _prefix_share(ref: str, other: str) -> float:
    n = 0
    for a, b in zip(ref, other, strict=False):
        if a != b:
            break
        n += 1
    return n / len(ref) if ref else 1.0


def greedy_agreement(
    model_path: str | None, prompts: tuple[str, ...], tokens: int, precisions: tuple[str, ...]
) -> dict[str, dict[str, float]]:
    ref = asyncio.run(_answers(model_path, "float32", prompts, tokens))
    out = {"float32": {"identical": 1.0, "prefix_share": 1.0}}
    for precision in precisions:
        got = asyncio.run(_answers(model_path, precision, prompts, tokens))
        out[precision] = {
            "identical": sum(a == b for a, b in zip(ref, got, strict=True)) / len(prompts),
            "prefix_share": sum(_prefix_share(a, b) for a, b in zip(ref, got, strict=True))
            / len(prompts),
        }
    return out


def report(ppl: dict[str, Any], greedy: dict[str, Any]) -> str:
    lines = [
        "precision   perplexity  ratio to fp32  top-1 agreement  greedy identical  greedy prefix",
    ]
    for p in ("float32", *PRECISIONS):
        if p not in ppl:
            continue
        a, g = ppl[p], greedy.get(p, {})
        same, prefix = g.get("identical", float("nan")), g.get("prefix_share", float("nan"))
        lines.append(
            f"{p:10s}  {a['perplexity']:10.3f}  {a['ratio']:13.4f}  {a['top1_agreement']:15.3f}"
            f"  {same:16.3f}  {prefix:13.3f}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.precision", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--model-path", default=None, help="a local checkpoint (default: embedded)")
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--window-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--quick", action="store_true", help="4 windows of 128 tokens, 4 prompts")
    ap.add_argument("--no-greedy", action="store_true", help="perplexity only")
    ap.add_argument("--out", type=Path, default=None, help="write DIR/precision.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.quick:
        args.windows, args.window_tokens, args.prompts, args.tokens = 4, 128, 4, 24
    precisions = tuple(p for p in args.precisions.split(",") if p)
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        raise SystemExit(f"--precisions takes {', '.join(PRECISIONS)}; got {', '.join(unknown)}")
    started = time.perf_counter()
    ppl = perplexities(args.model_path, args.windows, args.window_tokens, precisions)
    greedy = (
        {}
        if args.no_greedy
        else greedy_agreement(args.model_path, PROMPTS[: args.prompts], args.tokens, precisions)
    )
    result = {
        "corpus": "pydoc_data.topics (CPython)",
        **ppl.pop("_corpus"),  # type: ignore[dict-item]
        "window_tokens": args.window_tokens,
        "prompts": args.prompts,
        "tokens": args.tokens,
        "perplexity": ppl,
        "greedy": greedy,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(report(ppl, greedy))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "precision.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
