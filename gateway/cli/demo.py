"""`visiongate demo`: a real two-turn conversation about a real photo, end to end.

Starts the gateway on a free loopback port in this process, connects with the Python SDK,
sends the photo first (so it is encoded while the question is "typed"), asks two questions,
prints the answers as they stream and one timing line per turn, and exits 0.
"""

from __future__ import annotations

import asyncio
import io
import sys
import time
from pathlib import Path

from gateway.settings import Settings

__all__ = ("photo_jpeg", "run_demo", "timing_line")

QUESTIONS = (
    "Describe this photo in two sentences.",
    "What would be a good title for it?",
)


def photo_jpeg(name: str) -> bytes:
    """A scikit-image sample photo (astronaut, chelsea, coffee, rocket, ...) or a file, as JPEG."""
    if Path(name).is_file():
        return Path(name).read_bytes()
    from PIL import Image
    from skimage import data

    loader = getattr(data, name, None)
    if loader is None:
        raise SystemExit(f"visiongate demo: no sample photo or file named {name!r}")
    img = Image.fromarray(loader()).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=92)
    return buf.getvalue()


def timing_line(turn: int, result, wall_ttft_ms: float | None = None) -> str:
    t, c = result.timings, result.cache
    tps = result.usage.get("output_tokens", 0) / max(t.get("decode_ms", 0.0) / 1e3, 1e-9)
    return (
        f"[turn {turn}] queue {t.get('queue_ms', 0):.0f} ms | encode {t.get('encode_ms', 0):.0f} ms"
        f" | prefill {t.get('prefill_ms', 0):.0f} ms | TTFT {t.get('ttft_ms', 0):.0f} ms"
        f" | total {t.get('total_ms', 0):.0f} ms | {result.usage.get('output_tokens', 0)} tokens"
        f" at {tps:.1f} tok/s | image tokens {result.image_tokens}/{result.image_tokens_total}"
        f" | vision cache {c.get('vision')} | KV reused {result.cached_tokens} tokens"
    )


async def _conversation(url: str, photo: bytes, max_output_tokens: int, out) -> list:
    from gateway.sdk.client import RealtimeClient

    results = []
    async with await RealtimeClient.connect(url) as client:
        print(f"session {client.session_id} on {url}", file=out)
        item = await client.add_image(photo)
        encoded = await client.wait_encoded(item)
        print(
            f"image {encoded['digest'][:12]} encoded: {encoded['tokens_kept']}/"
            f"{encoded['tokens_total']} visual tokens kept in {encoded['encode_ms']:.0f} ms",
            file=out,
        )
        for turn, question in enumerate(QUESTIONS, 1):
            print(f"\n> {question}", file=out)
            answer = await client.ask(question, max_output_tokens=max_output_tokens)
            async for text in answer:
                out.write(text)
                out.flush()
            print("", file=out)
            print(timing_line(turn, answer.result), file=out)
            results.append(answer.result)
    return results


def run_demo(
    settings: Settings, *, photo: str = "astronaut", max_output_tokens: int = 64, out=sys.stdout
) -> int:
    import msgspec

    from gateway.server.app import create_app
    from gateway.server.runner import ServerThread
    from gateway.telemetry import configure_logging

    # the demo's own output is the conversation; server logs only when something is wrong
    if settings.log_level == "info":
        settings = msgspec.structs.replace(settings, log_level="warning")
    configure_logging(settings.log_level)
    image = photo_jpeg(photo)
    t0 = time.perf_counter()
    print("starting visiongate (the first run converts the embedded model once) ...", file=out)
    with ServerThread(create_app(settings), settings) as server:
        server.wait_ready()
        print(f"ready in {time.perf_counter() - t0:.1f} s", file=out)
        results = asyncio.run(_conversation(server.ws_url, image, max_output_tokens, out))
    ok = all(r.status in ("completed", "incomplete") and r.text.strip() for r in results)
    return 0 if ok else 1
