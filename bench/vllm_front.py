"""A real vLLM alone against visiongate in front of it, on the same multi-turn photo workload.

    python -m bench.vllm_front --out DIR [--sessions 4] [--max-tokens 32] [--compile]

One vLLM server (the CPU build, `make vllm-env`; `gateway.testing.vllm_server`) serves a
random-weight Qwen2.5-VL checkpoint built with transformers' classes, scaled to fit a small CPU
(`BENCH_SHAPES`: a 6-layer 576-wide language model with 64-wide heads, SmolLM2-135M's width;
a 6-block 256-wide vision tower whose photos become 144 visual tokens). Two
`visiongate serve --engine openai` gateways sit in front of it as child processes: data-URL
mode, and embeds mode (the gateway's encoder runs the checkpoint's vision tower, exact mode:
`--pruning none`, and warms the replica's prefix cache for a photo sent ahead).

Each session is a new photo and two turns, streamed with the official `openai` client; TTFT is
request sent -> first text, as the client sees it:

- "vllm alone": a stateless client re-sending the history and the photo (data URL) each turn;
- "data_url": the same requests through the data-URL gateway (with a session id);
- "embeds+ahead": the photo uploaded into the session first (`POST /v1/images`), the question
  asked once the gateway has encoded it and warmed the replica, the follow-up after.

Latency runs the sessions one at a time; throughput runs `--sessions` of them at once at
concurrency 1 and 8 (two turns each, `--max-tokens` per answer) and divides the output tokens
by the wall time. Ratios are against vLLM alone in the same run. Writes DIR/vllm_front.json.

`--follow-ups-only` measures what a follow-up costs through the gateway and nothing else:
`--sessions` rounds, each a new photo and two turns in every mode in turn ("vllm alone",
"data_url", and "embeds": the same inline photo through the embeds gateway), no throughput
runs. It prints each mode's median follow-up TTFT, the median of its difference from vLLM
alone's in the same round (both follow-ups hit the replica's prefix cache alike: the cached
tokens are printed beside), and where the gateway's follow-ups spent their time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

__all__ = ("BENCH_SHAPES", "main")

SERVED = "bench/qwen2.5-vl-small"
QUESTIONS = ("What is in this photo?", "What colours does it have?")
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry")
SIDE = 28 * 12  # the photos' size: 12 x 12 = 144 merged visual tokens
# scaled so that vision encoding and prefill are both real work on 2 cores
BENCH_SHAPES = {
    "vision": {
        "depth": 6,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_heads": 4,
        "out_hidden_size": 576,
        "fullatt_block_indexes": [2, 5],
    },
    "text": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 6,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": [8, 12, 12],
        },
    },
}


def build_checkpoint(root: Path) -> Path:
    """The bench's Qwen2.5-VL checkpoint (random weights, `BENCH_SHAPES`), vLLM-loadable."""
    from bench._encoder_vlm import checkpoint_builder
    from gateway.testing.vllm_server import add_video_processor_config

    qwen2_5_vl = checkpoint_builder("qwen2_5_vl", "bench.vllm_front")
    path = qwen2_5_vl.build(
        root / "qwen2.5-vl-small",
        vision=BENCH_SHAPES["vision"],
        text=BENCH_SHAPES["text"],
        min_pixels=SIDE * SIDE,
        max_pixels=SIDE * SIDE,
    )
    return add_video_processor_config(path)


def photo(name: str, n: int) -> bytes:
    """A distinct JPEG per (name, n): a 1-px-shifted crop, resized to SIDE x SIDE."""
    import io

    from PIL import Image

    from gateway.testing.images import photo_array

    img = Image.fromarray(photo_array(name)).convert("RGB")
    w, h = img.size
    img = img.crop((n, n, w - 1, h - 1)).resize((SIDE, SIDE))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def stream(client: Any, messages: list[dict], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """One streamed chat completion: TTFT, total time, text and output tokens."""
    sent = time.perf_counter()
    first = None
    parts: list[str] = []
    usage = None
    for chunk in client.chat.completions.create(
        model=SERVED,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if first is None:
                    first = time.perf_counter()
                parts.append(choice.delta.content)
    end = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "ttft_ms": round(((first or end) - sent) * 1e3, 2),
        "total_ms": round((end - sent) * 1e3, 2),
        "text": "".join(parts),
        "output_tokens": usage.completion_tokens if usage else len(parts),
        "prompt_tokens": usage.prompt_tokens if usage else 0,
        "cached_tokens": (getattr(details, "cached_tokens", 0) or 0) if details else 0,
    }


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def session(
    mode: str, client: Any, gateway_url: str | None, image: bytes, sid: str, max_tokens: int
) -> list[dict[str, Any]]:
    """Two turns of one session in `mode`; each turn's measurements."""
    from gateway.testing.images import data_url

    extra: dict[str, Any] = {} if mode == "vllm" else {"extra_body": {"session_id": sid}}
    url = data_url(image, "image/jpeg")
    if mode == "embeds+ahead":
        assert gateway_url is not None
        up = httpx.post(
            f"{gateway_url}/v1/images",
            content=image,
            headers={"content-type": "image/jpeg", "x-session-id": sid},
            timeout=120,
        )
        up.raise_for_status()
        ref, digest = up.json()["ref"], up.json()["id"]
        deadline = time.monotonic() + 120
        while httpx.get(f"{gateway_url}/v1/images/{digest}", timeout=10).json()["status"] != (
            "ready"
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the photo sent ahead was not encoded within 120 s")
            time.sleep(0.02)
        time.sleep(1.0)  # the user types the question; the warm-up runs meanwhile
        url = ref
    history = [
        {"role": "user", "content": [image_part(url), {"type": "text", "text": QUESTIONS[0]}]}
    ]
    first = stream(client, history, max_tokens, **extra)
    history += [
        {"role": "assistant", "content": first["text"]},
        {"role": "user", "content": QUESTIONS[1]},
    ]
    return [first, stream(client, history, max_tokens, **extra)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_front", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--compile", action="store_true", help="vLLM with torch.compile")
    parser.add_argument(
        "--follow-ups-only",
        action="store_true",
        help="only the follow-up latency: paired with vLLM alone by round, no throughput runs",
    )
    args = parser.parse_args(argv)

    import openai

    from gateway.testing.processes import front, running
    from gateway.testing.vllm_server import VllmServer, vllm_missing

    missing = vllm_missing()
    if missing:
        print(f"bench.vllm_front: {missing}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm-front-"))
    checkpoint = build_checkpoint(work)
    vllm = VllmServer(
        checkpoint,
        served_model_name=SERVED,
        mm_embeds=True,
        eager=not args.compile,
        log_dir=work,
        max_model_len=4096,
    )
    results: dict[str, Any] = {
        "shapes": BENCH_SHAPES,
        "side": SIDE,
        "args": vars(args) | {"out": str(args.out)},
    }
    with vllm:
        gw_bytes = front("gw-data-url", [vllm.url], work, "--upstream-model", SERVED)
        gw_embeds = front(
            "gw-embeds",
            [vllm.url],
            work,
            "--upstream-model",
            SERVED,
            "--upstream-images",
            "embeds",
            "--model-path",
            str(checkpoint),
            "--pruning",
            "none",
        )
        with running(gw_bytes, gw_embeds):
            if args.follow_ups_only:
                results["follow_ups"] = follow_ups(
                    {
                        "vllm": (vllm.base_url, None),
                        "data_url": (gw_bytes.base_url, gw_bytes.log_path),
                        "embeds": (gw_embeds.base_url, gw_embeds.log_path),
                    },
                    args.sessions,
                    args.max_tokens,
                )
                (args.out / "vllm_front.json").write_text(json.dumps(results, indent=2))
                print(follow_up_table(results["follow_ups"]))
                print(f"bench.vllm_front: wrote {args.out / 'vllm_front.json'}")
                return 0
            clients = {
                "vllm": (openai.OpenAI(base_url=vllm.base_url, api_key="x", max_retries=0), None),
                "data_url": (openai.OpenAI(base_url=gw_bytes.base_url, api_key="x"), gw_bytes.url),
                "embeds+ahead": (
                    openai.OpenAI(base_url=gw_embeds.base_url, api_key="x"),
                    gw_embeds.url,
                ),
            }
            n = 0
            # one warm-up session per mode (first requests of a process are slower)
            for mode, (client, url) in clients.items():
                n += 1
                session(mode, client, url, photo("camera", n), f"warm-{mode}", 4)
            latency: dict[str, list[list[dict]]] = {m: [] for m in clients}
            for i in range(args.sessions):
                for mode, (client, url) in clients.items():  # modes interleave
                    n += 1
                    name = PHOTOS[i % len(PHOTOS)]
                    latency[mode].append(
                        session(
                            mode, client, url, photo(name, n), f"lat-{mode}-{i}", args.max_tokens
                        )
                    )
            results["latency"] = latency
            throughput: dict[str, dict[str, float]] = {}
            for concurrency in (1, 8):
                for mode, (client, url) in clients.items():
                    jobs = []
                    for i in range(max(concurrency, args.sessions)):
                        n += 1
                        jobs.append(
                            (photo(PHOTOS[i % len(PHOTOS)], n), f"tp{concurrency}-{mode}-{i}")
                        )
                    started = time.perf_counter()
                    with ThreadPoolExecutor(concurrency) as pool:
                        done = list(
                            pool.map(
                                lambda job, mode=mode, client=client, url=url: session(
                                    "data_url" if mode == "embeds+ahead" else mode,
                                    client,
                                    url,
                                    job[0],
                                    job[1],
                                    args.max_tokens,
                                ),
                                jobs,
                            )
                        )
                    wall = time.perf_counter() - started
                    tokens = sum(t["output_tokens"] for turns in done for t in turns)
                    throughput.setdefault(str(concurrency), {})[mode] = round(tokens / wall, 2)
            results["throughput_tokens_per_s"] = throughput
            results["breakdown"] = {
                mode: breakdown(mode, latency[mode], proc.log_path)
                for mode, proc in (("data_url", gw_bytes), ("embeds+ahead", gw_embeds))
            }
    summary = summarize(results)
    results["summary"] = summary
    (args.out / "vllm_front.json").write_text(json.dumps(results, indent=2))
    print(table(summary))
    print(breakdown_table(results["breakdown"]))
    print(f"bench.vllm_front: wrote {args.out / 'vllm_front.json'}")
    return 0


def follow_ups(
    modes: dict[str, tuple[str, Path | None]], rounds: int, max_tokens: int
) -> dict[str, Any]:
    """`rounds` sessions in every mode in turn (mode -> its base URL and, for a gateway, its
    log); a warm-up round first, left out. Each mode's follow-ups, its paired differences from
    vLLM alone's in the same round, and its gateway's breakdown."""
    import openai

    clients = {
        mode: openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        for mode, (url, _) in modes.items()
    }
    n = 0
    latency: dict[str, list[list[dict]]] = {m: [] for m in modes}
    for i in range(-1, rounds):
        for mode, client in clients.items():
            n += 1
            name = PHOTOS[i % len(PHOTOS)]
            turns = session(
                "vllm" if mode == "vllm" else "data_url",
                client,
                None,
                photo(name, n),
                f"lat-{mode}-{i}",
                max_tokens if i >= 0 else 4,
            )
            if i >= 0:
                latency[mode].append(turns)
    return {
        mode: {
            "follow_up_ttft_ms": statistics.median(s[1]["ttft_ms"] for s in latency[mode]),
            "follow_up_cached": statistics.median(s[1]["cached_tokens"] for s in latency[mode]),
            "follow_up_prompt": statistics.median(s[1]["prompt_tokens"] for s in latency[mode]),
            "paired_diff_ms": paired(latency[mode], latency["vllm"]),
            "turns": latency[mode],
            "breakdown": breakdown(mode, latency[mode], log) if log is not None else {},
        }
        for mode, (_, log) in modes.items()
    }


def paired(sessions: list[list[dict]], alone: list[list[dict]]) -> list[float]:
    """Each round's follow-up TTFT less vLLM alone's follow-up of the same round."""
    return [
        round(s[1]["ttft_ms"] - a[1]["ttft_ms"], 2) for s, a in zip(sessions, alone, strict=True)
    ]


def follow_up_table(by_mode: dict[str, Any]) -> str:
    rows = [f"{'mode':<12}{'follow-up ms':>14}{'- vllm alone ms':>17}{'cached/prompt':>15}"]
    for mode, m in by_mode.items():
        diff = statistics.median(m["paired_diff_ms"]) if mode != "vllm" else 0.0
        rows.append(
            f"{mode:<12}{m['follow_up_ttft_ms']:>14.1f}{diff:>17.1f}"
            f"{m['follow_up_cached']:>9.0f}/{m['follow_up_prompt']:<5.0f}"
        )
    rows.append(breakdown_table({k: m["breakdown"] for k, m in by_mode.items() if m["breakdown"]}))
    return "\n".join(rows)


def responses_logged(log_path: Path) -> dict[str, list[dict[str, Any]]]:
    """The gateway's access-log `response` lines by session id, in order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "response":
            out.setdefault(str(event.get("session_id")), []).append(event)
    return out


TIMINGS = ("ttft_ms", "prefill_ms")  # what `breakdown` reads of a response line


def breakdown(mode: str, sessions: list[list[dict[str, Any]]], log_path: Path) -> dict[str, Any]:
    """Where each latency turn's TTFT went, from the gateway's access log: `outside_ms` the
    client's TTFT less the gateway's own (the client's request building, the hop in, the
    request's parsing before the gateway's clock starts, and the way back: the first frames,
    the hop, the client's parsing), `gateway_ms` the gateway's own time (its TTFT less the
    replica's: the session's preparation, the prompt, the request to the replica),
    `replica_ms` the replica's time from the request sent to its first text, as the gateway
    saw it. Medians by turn (first, follow-up).

    Only durations are read: the line's timestamp is taken when the answer has been stored,
    after `total_ms` was, so a receipt time computed from it (timestamp less `total_ms`) comes
    late and makes the hop in look longer than it is (by ~6 ms on this machine)."""
    logged = responses_logged(log_path)
    rows: list[list[dict[str, float]]] = [[], []]
    for i, turns in enumerate(sessions):
        events = logged.get(f"lat-{mode}-{i}", [])
        if len(events) != len(turns) or any(
            not isinstance(e.get(k), (int, float)) for e in events for k in TIMINGS
        ):
            continue  # a turn the log does not show, or shows without timings: left out
        for turn, (measured, event) in enumerate(zip(turns, events, strict=True)):
            replica = float(event["prefill_ms"])
            rows[turn].append(
                {
                    "outside_ms": round(measured["ttft_ms"] - float(event["ttft_ms"]), 2),
                    "gateway_ms": round(float(event["ttft_ms"]) - replica, 2),
                    "replica_ms": replica,
                    "client_ttft_ms": measured["ttft_ms"],
                }
            )
    return {
        name: {k: statistics.median(r[k] for r in turn_rows) for k in turn_rows[0]}
        for name, turn_rows in zip(("first", "follow_up"), rows, strict=True)
        if turn_rows
    }


def breakdown_table(by_mode: dict[str, Any]) -> str:
    rows = [
        f"{'mode / turn':<24}{'client TTFT':>12}{'outside ms':>12}{'gateway ms':>12}"
        f"{'replica ms':>12}"
    ]
    for mode, turns in by_mode.items():
        for turn, m in turns.items():
            rows.append(
                f"{mode + ' ' + turn:<24}{m['client_ttft_ms']:>12.1f}{m['outside_ms']:>12.1f}"
                f"{m['gateway_ms']:>12.1f}{m['replica_ms']:>12.1f}"
            )
    return "\n".join(rows)


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, sessions in results["latency"].items():
        out[mode] = {
            "first_ttft_ms": statistics.median(s[0]["ttft_ms"] for s in sessions),
            "follow_up_ttft_ms": statistics.median(s[1]["ttft_ms"] for s in sessions),
            "first_cached": statistics.median(s[0]["cached_tokens"] for s in sessions),
            "follow_up_cached": statistics.median(s[1]["cached_tokens"] for s in sessions),
            "prompt_tokens": statistics.median(s[0]["prompt_tokens"] for s in sessions),
        }
    for concurrency, by_mode in results["throughput_tokens_per_s"].items():
        for mode, rate in by_mode.items():
            out[mode][f"tokens_per_s_x{concurrency}"] = rate
    return out


def table(summary: dict[str, Any]) -> str:
    base = summary["vllm"]
    rows = [
        f"{'mode':<14}{'1st TTFT ms':>13}{'ratio':>7}{'follow-up ms':>14}{'ratio':>7}"
        f"{'tok/s x1':>10}{'ratio':>7}{'tok/s x8':>10}{'ratio':>7}{'1st cached':>11}"
    ]
    for mode, m in summary.items():
        rows.append(
            f"{mode:<14}{m['first_ttft_ms']:>13.1f}"
            f"{m['first_ttft_ms'] / base['first_ttft_ms']:>7.2f}"
            f"{m['follow_up_ttft_ms']:>14.1f}"
            f"{m['follow_up_ttft_ms'] / base['follow_up_ttft_ms']:>7.2f}"
            f"{m['tokens_per_s_x1']:>10.1f}{m['tokens_per_s_x1'] / base['tokens_per_s_x1']:>7.2f}"
            f"{m['tokens_per_s_x8']:>10.1f}{m['tokens_per_s_x8'] / base['tokens_per_s_x8']:>7.2f}"
            f"{m['first_cached']:>11.0f}"
        )
    rows.append(
        "photo-ahead first turn vs vLLM alone's follow-up (a text turn on the replica): "
        f"{summary['embeds+ahead']['first_ttft_ms'] / base['follow_up_ttft_ms']:.2f}x"
    )
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
