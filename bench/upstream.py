"""Upstream replicas benchmark: what a gateway in front of OpenAI-compatible replicas adds to
the time to first token, and what session-affinity routing saves on follow-ups, in one run.

    python -m bench.upstream --out DIR [--requests 30] [--turns 3] [--conversations 6]

Two `visiongate serve` replicas (the embedded model, one engine thread each) and a front
gateway, `visiongate serve --engine openai --upstream R1,R2`, run as child processes on
loopback ports (gateway/testing/processes.py). Every request is a streamed chat completion sent
with the
official `openai` client; TTFT is request sent -> first text delta, as the client sees it.

(a) overhead: `--requests` prompts (a photo and a question) go through the front gateway and
    straight to the replica the front routes them to, interleaved (the order alternates). Each
    prompt is asked once on both paths beforehand, so every measured request is a whole-prefix
    cache hit on the same replica and the two paths do the same model work: the difference is
    what the front gateway adds (goal: at most 5 ms at P50, checked on the median of the
    paired differences). Beside it, from the gateways' own `visiongate.timings`: the front's
    share of its TTFT (its TTFT less the replica's as it measured it), and on each path the time
    outside the serving gateway's timer (the HTTP request's way in, the stream's way out).
(b) routing: `--conversations` conversations per mode, each a new photo and a question, then
    `--turns - 1` follow-ups that send the whole history again (stateless requests, as the
    OpenAI SDK pattern does). "affinity": through the front gateway, which keeps a conversation
    on one replica. "random": each turn straight to a replica chosen at random, as a load
    balancer without affinity would spread it (the front gateway has no random mode: this is
    the stateless load balancer itself, measured without a gateway hop). Follow-up TTFT of both
    (goal: affinity at most 0.5x random, of the means). Conversations of the two modes
    alternate; the replica that served each turn is read from the replicas' own metrics.

Writes DIR/upstream.json and DIR/upstream.png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench._load_stats import percentile

if TYPE_CHECKING:
    from openai import OpenAI

    from gateway.testing.processes import ServeProcess

__all__ = ("main", "parse_args", "summarize_overhead", "summarize_routing", "table")

OVERHEAD_GOAL_MS = 5.0
AFFINITY_GOAL = 0.5
QUESTIONS = (
    "What is in this photo?",
    "Describe the colours of this picture.",
    "What would be a good title for this image?",
    "Where might this photo have been taken?",
    "What mood does this picture have?",
    "Describe the main subject in one sentence.",
    "What is in the background?",
    "Write a short caption for this photo.",
)
FOLLOW_UPS = (
    "Tell me more about it.",
    "What colours stand out?",
    "Summarise our conversation in one sentence.",
    "Suggest another title.",
    "What would you change in it?",
)
RANDOM_MODE = (
    "each turn straight to a replica chosen at random with the whole history (a stateless load "
    "balancer; the front gateway has no random routing)"
)


@dataclass(slots=True)
class Target:
    """Where a request goes: a gateway's OpenAI endpoint and the model name it serves."""

    name: str
    client: OpenAI
    model: str


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.upstream",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", type=Path, required=True, help="directory for the JSON and PNG")
    ap.add_argument("--requests", type=int, default=30, help="(a) measured requests per path")
    ap.add_argument("--turns", type=int, default=3, help="(b) turns per conversation")
    ap.add_argument("--conversations", type=int, default=6, help="(b) conversations per mode")
    ap.add_argument("--max-tokens", type=int, default=8, help="output tokens per answer")
    ap.add_argument("--seed", type=int, default=0, help="the random routing's seed")
    args = ap.parse_args(argv)
    if args.requests < 2 or args.turns < 2 or args.conversations < 1 or args.max_tokens < 1:
        ap.error("--requests >= 2, --turns >= 2, --conversations >= 1, --max-tokens >= 1")
    return args


def _target(proc: ServeProcess) -> Target:
    from openai import OpenAI

    client = OpenAI(base_url=proc.base_url, api_key="bench", max_retries=0, timeout=300)
    return Target(proc.name, client, client.models.list().data[0].id)


def stream_turn(target: Target, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """One streamed completion: TTFT and total (ms), the answer, and the usage it reported."""
    started = time.perf_counter()
    stream = target.client.chat.completions.create(
        model=target.model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    ttft = None
    text: list[str] = []
    usage = None
    timings: dict[str, float] = {}
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = (time.perf_counter() - started) * 1e3
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
        extension = (chunk.model_extra or {}).get("visiongate")
        if isinstance(extension, dict) and extension.get("timings"):
            timings = extension["timings"]
    details = usage.prompt_tokens_details if usage is not None else None
    return {
        "ttft_ms": round(ttft, 2) if ttft is not None else None,
        "total_ms": round((time.perf_counter() - started) * 1e3, 2),
        "text": "".join(text),
        "prompt_tokens": usage.prompt_tokens if usage is not None else 0,
        "cached_tokens": (details.cached_tokens or 0) if details is not None else 0,
        # the gateway's own account: ttft_ms (received -> first delta sent) and, behind an
        # upstream engine, prefill_ms (the replica's time to first token as it saw it)
        "server_ttft_ms": timings.get("ttft_ms"),
        "server_prefill_ms": timings.get("prefill_ms"),
    }


def _user(photo: bytes | None, question: str) -> dict[str, Any]:
    from gateway.sdk.client import image_data_url

    content: list[dict[str, Any]] = []
    if photo is not None:
        content.append({"type": "image_url", "image_url": {"url": image_data_url(photo)}})
    content.append({"type": "text", "text": question})
    return {"role": "user", "content": content}


def _stats(values: list[float]) -> dict[str, float | None]:
    def r(v: float | None) -> float | None:
        return round(v, 2) if v is not None else None

    return {
        "n": len(values),
        "p50_ms": r(percentile(values, 50)),
        "p95_ms": r(percentile(values, 95)),
        "mean_ms": r(statistics.mean(values)) if values else None,
    }


# ---------------------------------------------------------------- (a) overhead


def measure_overhead(
    front: Target, replicas: list[Target], procs: list[ServeProcess], args: argparse.Namespace
) -> dict[str, Any]:
    from bench._load_client import session_image
    from gateway.testing.processes import responses_served, which_served

    # one photo for every prompt (a fixed index far from (b)'s), a different question each
    photo = session_image(4093)
    prompts = [
        [_user(photo, f"{QUESTIONS[i % len(QUESTIONS)]} (request {i})")]
        for i in range(args.requests)
    ]
    print(f"(a) warming {len(prompts)} prompts on both paths ...", flush=True)
    routes = []
    for messages in prompts:
        before = responses_served(procs)
        stream_turn(front, messages, args.max_tokens)
        routes.append(which_served(procs, before))
        stream_turn(replicas[routes[-1]], messages, args.max_tokens)
    rows: dict[str, list[dict[str, Any]]] = {"direct": [], "front": []}
    print(f"(a) measuring {len(prompts)} requests per path, interleaved ...", flush=True)
    for i, (messages, route) in enumerate(zip(prompts, routes, strict=True)):
        order = (("front", front), ("direct", replicas[route]))
        for path, target in order if i % 2 == 0 else order[::-1]:
            row = stream_turn(target, messages, args.max_tokens)
            row["replica"] = route
            rows[path].append(row)
        if (i + 1) % 5 == 0 or i + 1 == len(prompts):
            print(
                f"    {i + 1}/{len(prompts)}: front {rows['front'][-1]['ttft_ms']} ms, "
                f"direct {rows['direct'][-1]['ttft_ms']} ms",
                flush=True,
            )
    return summarize_overhead(rows)


def summarize_overhead(rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """P50/P95 of each path and their differences. What the goal is checked on is the median of
    the paired differences (each prompt on both paths, back to back, so the machine's drift
    between prompts cancels): the added time at P50, less noisy than a difference of P50s.
    `front_own_ms` is the front gateway's own account of its share (its TTFT less the
    replica's time to first token as it measured it), without the client's noise."""
    out: dict[str, Any] = {}
    for path in ("direct", "front"):
        ttfts = [r["ttft_ms"] for r in rows[path] if r["ttft_ms"] is not None]
        out[path] = {
            **_stats(ttfts),
            "cached_tokens_mean": statistics.mean(r["cached_tokens"] for r in rows[path]),
            "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in rows[path]),
            "failed": sum(1 for r in rows[path] if r["ttft_ms"] is None),
            "ttft_ms": [r["ttft_ms"] for r in rows[path]],
            # the client's TTFT less the serving gateway's own: the HTTP request's way in
            # before the gateway's timer starts, the stream's way out, and the client
            "outside_timer_ms": _stats(
                [
                    r["ttft_ms"] - r["server_ttft_ms"]
                    for r in rows[path]
                    if r["ttft_ms"] is not None and r.get("server_ttft_ms") is not None
                ]
            ),
        }
    d, f = out["direct"], out["front"]
    paired = [
        b["ttft_ms"] - a["ttft_ms"]
        for a, b in zip(rows["direct"], rows["front"], strict=True)
        if a["ttft_ms"] is not None and b["ttft_ms"] is not None
    ]
    own = [
        r["server_ttft_ms"] - r["server_prefill_ms"]
        for r in rows["front"]
        if r.get("server_ttft_ms") is not None and r.get("server_prefill_ms") is not None
    ]
    added = statistics.median(paired) if paired else None
    out.update(
        added_paired_median_ms=round(added, 2) if added is not None else None,
        added_p50_ms=_minus(f["p50_ms"], d["p50_ms"]),
        added_p95_ms=_minus(f["p95_ms"], d["p95_ms"]),
        front_own_ms=_stats(own),
        goal_p50_ms=OVERHEAD_GOAL_MS,
        within_goal=added is not None and added <= OVERHEAD_GOAL_MS,
        replicas_used=sorted({r["replica"] for r in rows["front"]}),
    )
    return out


def _minus(a: float | None, b: float | None) -> float | None:
    return round(a - b, 2) if a is not None and b is not None else None


# ---------------------------------------------------------------- (b) routing


def play(
    route: Any,
    photo: bytes,
    index: int,
    turns: int,
    max_tokens: int,
) -> list[dict[str, Any]]:
    """One conversation: `route(turn)` gives each turn's target; the whole history is sent."""
    messages = [_user(photo, QUESTIONS[index % len(QUESTIONS)])]
    rows = []
    for turn in range(turns):
        if turn:
            messages.append({"role": "user", "content": FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]})
        row = route(turn, messages, max_tokens)
        row["turn"] = turn
        rows.append(row)
        messages.append({"role": "assistant", "content": row["text"]})
    return rows


def measure_routing(
    front: Target, replicas: list[Target], procs: list[ServeProcess], args: argparse.Namespace
) -> dict[str, Any]:
    from bench._load_client import session_image
    from gateway.testing.processes import responses_served, which_served

    rng = random.Random(args.seed)

    def through_front(turn: int, messages: list[dict[str, Any]], max_tokens: int) -> dict:
        before = responses_served(procs)
        row = stream_turn(front, messages, max_tokens)
        row["replica"] = which_served(procs, before)
        return row

    def at_random(turn: int, messages: list[dict[str, Any]], max_tokens: int) -> dict:
        choice = rng.randrange(len(replicas))
        row = stream_turn(replicas[choice], messages, max_tokens)
        row["replica"] = choice
        return row

    conversations: dict[str, list[list[dict[str, Any]]]] = {"affinity": [], "random": []}
    print(
        f"(b) {args.conversations} conversations per mode, {args.turns} turns each "
        f"(random: {RANDOM_MODE}) ...",
        flush=True,
    )
    for c in range(args.conversations):
        modes = (("affinity", through_front), ("random", at_random))
        for m, (mode, route) in enumerate(modes if c % 2 == 0 else modes[::-1]):
            photo = session_image(2 * c + m)  # a new photo for every conversation
            rows = play(route, photo, c, args.turns, args.max_tokens)
            conversations[mode].append(rows)
            follow = [r["ttft_ms"] for r in rows[1:]]
            print(
                f"    conversation {c + 1} {mode:8s}: replicas {[r['replica'] for r in rows]}, "
                f"turn 1 {rows[0]['ttft_ms']} ms, follow-ups {follow} ms",
                flush=True,
            )
    return summarize_routing(conversations)


def summarize_routing(conversations: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    """Follow-up TTFT per mode, and affinity over random (of the means and of the P50s)."""
    out: dict[str, Any] = {"random_mode": RANDOM_MODE}
    for mode, convs in conversations.items():
        follow = [r for rows in convs for r in rows[1:]]
        ttfts = [r["ttft_ms"] for r in follow if r["ttft_ms"] is not None]
        out[mode] = {
            "followup": _stats(ttfts),
            "first_turn": _stats([rows[0]["ttft_ms"] for rows in convs if rows[0]["ttft_ms"]]),
            "followup_cached_tokens_mean": statistics.mean(r["cached_tokens"] for r in follow)
            if follow
            else None,
            "followup_prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in follow)
            if follow
            else None,
            "replicas_per_conversation": [len({r["replica"] for r in rows}) for rows in convs],
            "failed": sum(1 for r in follow if r["ttft_ms"] is None),
            "conversations": [
                [{k: r[k] for k in ("turn", "replica", "ttft_ms", "cached_tokens")} for r in rows]
                for rows in convs
            ],
        }
    a, r = out["affinity"]["followup"], out["random"]["followup"]
    out["ratio_mean"] = (
        round(a["mean_ms"] / r["mean_ms"], 3) if a["mean_ms"] and r["mean_ms"] else None
    )
    out["ratio_p50"] = round(a["p50_ms"] / r["p50_ms"], 3) if a["p50_ms"] and r["p50_ms"] else None
    out["goal"] = AFFINITY_GOAL
    out["within_goal"] = out["ratio_mean"] is not None and out["ratio_mean"] <= AFFINITY_GOAL
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


# ---------------------------------------------------------------- report


def table(report: dict[str, Any]) -> str:
    """The side-by-side text table of both measurements."""
    o, r = report["overhead"], report["routing"]

    def ms(v: float | None) -> str:
        return f"{v:9.1f}" if v is not None else "        -"

    def row(label: str, stats: dict[str, Any]) -> str:
        return f"    {label:<48}{ms(stats['p50_ms'])} {ms(stats['p95_ms'])} {ms(stats['mean_ms'])}"

    head = f"{'P50 ms':>9} {'P95 ms':>9} {'mean ms':>9}"
    fa, fr = r["affinity"], r["random"]
    title_a = f"(a) TTFT, the same prompts, interleaved ({o['front']['n']} each)"
    title_b = f"(b) follow-up TTFT, 2 replicas ({fa['followup']['n']} each)"
    lines = [
        f"{title_a:<52}{head}",
        row("straight to the replica", o["direct"]),
        row("through the front gateway", o["front"]),
        f"    {'difference':<48}{ms(o['added_p50_ms'])} {ms(o['added_p95_ms'])}",
        row("the front's own share (its timings)", o["front_own_ms"]),
        row("direct: outside the replica's timer", o["direct"]["outside_timer_ms"]),
        row("front: outside the front's timer", o["front"]["outside_timer_ms"]),
        f"    added at P50 (median of paired differences): {o['added_paired_median_ms']} ms "
        f"(goal <= {o['goal_p50_ms']:.0f} ms: {'met' if o['within_goal'] else 'NOT met'})",
        "",
        f"{title_b:<52}{head}",
        row("affinity (through the front gateway)", fa["followup"]),
        row("random (straight to a random replica)", fr["followup"]),
        f"    affinity / random: {r['ratio_mean']}x of the means, {r['ratio_p50']}x at P50 "
        f"(goal <= {r['goal']}x of the means: {'met' if r['within_goal'] else 'NOT met'})",
        f"    prompt tokens cached per follow-up: affinity "
        f"{fa['followup_cached_tokens_mean']:.0f}, random {fr['followup_cached_tokens_mean']:.0f}"
        f" (of {fa['followup_prompt_tokens_mean']:.0f} on average)",
        f"    random: {r['random_mode']}",
    ]
    return "\n".join(lines) + "\n"


def chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    o, r = report["overhead"], report["routing"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.boxplot(
        [
            [v for v in o["direct"]["ttft_ms"] if v is not None],
            [v for v in o["front"]["ttft_ms"] if v is not None],
        ]
    )
    left.set_xticks([1, 2], ["straight to replica", "through gateway"])
    left.set_ylabel("TTFT (ms)")
    left.set_title(f"(a) same prompts, added at P50: {o['added_paired_median_ms']} ms")
    modes = ("affinity", "random")
    for k, stat in enumerate(("p50_ms", "mean_ms", "p95_ms")):
        values = [r[m]["followup"][stat] or 0.0 for m in modes]
        right.bar([x + 0.27 * k for x in range(2)], values, width=0.25, label=stat[:-3])
    right.set_xticks([0.27, 1.27], ["affinity (gateway)", "random (direct)"])
    right.set_ylabel("follow-up TTFT (ms)")
    right.set_title(f"(b) affinity / random = {r['ratio_mean']}x (means)")
    right.legend()
    fig.suptitle("visiongate in front of 2 upstream replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from gateway.testing.processes import front, replica, running

    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="visiongate-upstream-bench-"))
    started = time.perf_counter()
    ups = [replica(f"replica{i}", logs) for i in (1, 2)]
    gateway = front("front", ups, logs)
    print(f"starting 2 replicas and the front gateway (logs in {logs}) ...", flush=True)
    # the front gateway starts once the replicas answer: it learns their model at start
    with running(*ups), running(gateway):
        print(f"ready after {time.perf_counter() - started:.0f} s", flush=True)
        targets = [_target(p) for p in ups]
        front_target = _target(gateway)
        phase = time.perf_counter()
        overhead = measure_overhead(front_target, targets, ups, args)
        print(f"(a) done in {time.perf_counter() - phase:.0f} s", flush=True)
        phase = time.perf_counter()
        routing = measure_routing(front_target, targets, ups, args)
        print(f"(b) done in {time.perf_counter() - phase:.0f} s", flush=True)
    report = {
        "model": targets[0].model,
        "replicas": 2,
        "requests": args.requests,
        "turns": args.turns,
        "conversations": args.conversations,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "overhead": overhead,
        "routing": routing,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    (args.out / "upstream.json").write_text(json.dumps(report, indent=2))
    chart(report, args.out / "upstream.png")
    print()
    print(table(report))
    print(f"wrote {args.out / 'upstream.json'} and {args.out / 'upstream.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
