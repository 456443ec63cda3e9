"""Responses prewarm benchmark: a photo sent with `prompt_cache_options.prewarm`, then the question.

One gateway runs in this process on a loopback port, serving the embedded model. Per trial
(each with a photo of its own, a pixel changed, so no trial reuses another's KV or visual
tokens), with the official `openai` client over HTTP, streamed, greedy:

- `prewarmed_question`: the photo sent as a prewarm (`prompt_cache_options={"prewarm": true}`,
  no output), then the question with `previous_response_id`; TTFT is the question's (request
  sent -> first text delta received);
- `text_followup`: the same chain's next, text-only question of about the same length;
- `photo_with_question`: photo and question in one request (encode and prefill on the path),
  for scale.

The goal (the KV warm-up benchmark's): the prewarmed question's median TTFT <= 1.3x the
text-only follow-up's. The prewarmed question's answer is checked token for token against the
same conversation sent in one request without prewarm (two user messages: photo, question).

    python -m bench.responses_prewarm --out bench/out     # writes responses_prewarm.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.warmup import FOLLOW_UP, INSTRUCTIONS, QUESTION, photo, start_gateway

CONDITIONS = ("prewarmed_question", "text_followup", "photo_with_question")
GOAL = 1.3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench/out", help="output directory")
    parser.add_argument("--trials", type=int, default=5, help="trials (5)")
    parser.add_argument("--max-tokens", type=int, default=12, help="per answer (12)")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.max_tokens < 1:
        parser.error("--trials and --max-tokens must be >= 1")
    return args


def photo_input(data: bytes) -> list[dict[str, Any]]:
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    return [{"role": "user", "content": [{"type": "input_image", "image_url": url}]}]


async def timed(client: Any, max_tokens: int, **body: Any) -> tuple[float, Any]:
    """Stream one response; (client-side TTFT ms, the completed response)."""
    t0 = time.perf_counter()
    ttft = None
    stream = await client.responses.create(
        model=client.model,
        instructions=INSTRUCTIONS,
        max_output_tokens=max_tokens,
        temperature=0,
        stream=True,
        **body,
    )
    done = None
    async for event in stream:
        if event.type == "response.output_text.delta" and ttft is None:
            ttft = (time.perf_counter() - t0) * 1e3
        elif event.type in ("response.completed", "response.incomplete", "response.failed"):
            done = event.response
    assert done is not None and done.status != "failed", done
    return round(ttft or 0.0, 1), done


async def trial(client: Any, index: int, max_tokens: int) -> dict[str, Any]:
    row: dict[str, Any] = {}
    warmed = await client.responses.create(
        model=client.model,
        instructions=INSTRUCTIONS,
        input=photo_input(photo(index)),
        prompt_cache_options={"prewarm": True},
    )
    row["prewarm_usage"] = warmed.usage.model_dump()
    row["prewarm_notes"] = warmed.visiongate["notes"]
    ttft, asked = await timed(client, max_tokens, input=QUESTION, previous_response_id=warmed.id)
    row["prewarmed_question"] = ttft
    row["prewarmed_answer"] = asked.output_text
    row["prewarmed_cached_tokens"] = asked.usage.input_tokens_details.cached_tokens
    row["prewarmed_input_tokens"] = asked.usage.input_tokens
    ttft, _ = await timed(client, max_tokens, input=FOLLOW_UP, previous_response_id=asked.id)
    row["text_followup"] = ttft
    # the same conversation in one request, no prewarm (a fresh chain; the photo's tokens are
    # cached by now, its KV too: this checks the answer, not the time)
    _, plain = await timed(
        client,
        max_tokens,
        input=[*photo_input(photo(index)), {"role": "user", "content": QUESTION}],
        store=False,
    )
    row["answer_without_prewarm"] = plain.output_text
    # photo and question together, a photo of its own: encode and prefill on the path
    both = photo_input(photo(1000 + index))
    both[0]["content"].append({"type": "input_text", "text": QUESTION})
    ttft, _ = await timed(client, max_tokens, input=both, store=False)
    row["photo_with_question"] = ttft
    return row


async def run(base_url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=600) as client:
        client.model = (await client.models.list()).data[0].id  # type: ignore[attr-defined]
        await trial(client, 0, args.max_tokens)  # warm the process (first-call costs)
        return [await trial(client, i + 1, args.max_tokens) for i in range(args.trials)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from gateway.telemetry import configure_logging

    configure_logging("warning")
    print("starting a gateway (embedded model) ...", flush=True)
    server = start_gateway()
    try:
        rows = asyncio.run(run(f"{server.http_url}/v1", args))
    finally:
        server.stop()
    medians = {c: statistics.median(r[c] for r in rows) for c in CONDITIONS}
    base = medians["text_followup"] or 1.0
    ratios = {c: round(medians[c] / base, 2) for c in CONDITIONS}
    equal = all(r["prewarmed_answer"] == r["answer_without_prewarm"] for r in rows)
    summary = {
        "ttft_ms_median": medians,
        "ratio_vs_text_followup": ratios,
        "goal_prewarmed_question_vs_text_followup": GOAL,
        "goal_met": ratios["prewarmed_question"] <= GOAL,
        "answers_equal_with_and_without_prewarm": equal,
    }
    report = {
        "benchmark": "responses_prewarm",
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "summary": summary,
        "trials": rows,
    }
    path = out / "responses_prewarm.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"\nTTFT, median of {args.trials} trials (ratio to the text-only follow-up)")
    for c in CONDITIONS:
        print(f"  {c:<22}{medians[c]:>10.0f} ms  ({ratios[c]:.2f}x)")
    print(
        f"goal: prewarmed_question <= {GOAL}x text_followup: "
        f"{'met' if summary['goal_met'] else 'NOT met'}"
    )
    print(f"greedy answers identical with and without prewarm: {equal}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
