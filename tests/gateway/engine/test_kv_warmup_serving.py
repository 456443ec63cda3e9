"""KV warm-up through a real gateway: a photo sent ahead of its question over the Realtime API.

For the embedded model and each tiny VLM family (LLaVA, Idefics3, Qwen2.5-VL with its M-RoPE
positions), two gateways serve one checkpoint: KV warm-up on (the default) and off. The same
conversation goes to both over the real `websockets` client: instructions, a photo item, then
(once the warm-up is counted on `/metrics`) a question item and a greedy response. The answers
must be token-identical; the warmed one reports `kv_warmed_tokens` (the prompt through the photo
item) and the other none.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.server import ServerThread
from tests.conftest import photo_bytes
from tests.gateway.conftest import gateway_settings
from tests.gateway.realtime_helpers import Peer, data_url, deltas

pytestmark = pytest.mark.slow

FAMILIES = ("embedded", "llava", "idefics3", "qwen2_5_vl")
INSTRUCTIONS = "You describe pictures."
QUESTION = "What is in this picture?"
MAX_TOKENS = 12
WARMED = re.compile(r'^visiongate_kv_warmups_total\{[^}]*outcome="warmed"[^}]*\} (\S+)', re.M)


@functools.cache
def _photo() -> bytes:
    return photo_bytes("astronaut", fmt="PNG")


@pytest.fixture(scope="module", params=FAMILIES)
def gateways(request, tmp_path_factory) -> Iterator[tuple[ServerThread, ServerThread]]:
    overrides: dict[str, Any] = {"max_output_tokens": MAX_TOKENS}
    if request.param != "embedded":
        builder = importlib.import_module(f"tests.vlm_checkpoints.{request.param}")
        path = builder.build(tmp_path_factory.mktemp(request.param) / "ckpt")
        overrides.update(model_path=str(path), pruning="none", visual_tokens="fp32", device="cpu")
    on = gateway_settings(**overrides)
    off = gateway_settings(**overrides, kv_warmup=False)
    assert on.kv_warmup and not off.kv_warmup
    # one after the other: two threads loading a checkpoint at once race in transformers' imports
    with ServerThread(create_app(on), on) as warm:
        warm.wait_ready()
        with ServerThread(create_app(off), off) as cold:
            cold.wait_ready()
            yield warm, cold


def _warmed(server: ServerThread) -> float:
    text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    return sum(float(v) for v in WARMED.findall(text))


async def _photo_ahead(server: ServerThread, *, wait_for_warm_up: bool) -> tuple[str, dict]:
    peer = await Peer.open(server.ws_url)
    try:
        await peer.send(
            {
                "type": "session.update",
                "session": {"type": "realtime", "instructions": INSTRUCTIONS},
            }
        )
        await peer.until("session.updated")
        before = await asyncio.to_thread(_warmed, server)
        await peer.add([{"type": "input_image", "image_url": data_url(_photo(), "image/png")}])
        await peer.until("conversation.item.done")
        if wait_for_warm_up:  # the user is still typing
            deadline = time.monotonic() + 120
            while await asyncio.to_thread(_warmed, server) <= before:
                assert time.monotonic() < deadline, "no warm-up was counted"
                await asyncio.sleep(0.1)
        await peer.add([{"type": "input_text", "text": QUESTION}])
        await peer.until("conversation.item.done")
        done, events = await peer.respond(max_output_tokens=MAX_TOKENS)
        assert not [e for e in events if e["type"] == "error"], events
        return deltas(events), done["response"]
    finally:
        await peer.close()


async def test_photo_ahead_answer_is_identical_with_and_without_warm_up(gateways) -> None:
    warm, cold = gateways
    hot_text, hot = await _photo_ahead(warm, wait_for_warm_up=True)
    cold_text, cold_done = await _photo_ahead(cold, wait_for_warm_up=False)
    assert hot_text == cold_text
    assert hot["usage"]["output_tokens"] == cold_done["usage"]["output_tokens"]
    assert hot["usage"]["input_tokens"] == cold_done["usage"]["input_tokens"]
    image_tokens = hot["usage"]["input_token_details"]["image_tokens"]
    cache = hot["visiongate"]["cache"]
    # the prompt through the photo item, image included, was prefilled before the question
    assert cache["kv_warmed_tokens"] > image_tokens
    assert cache["kv_tokens_reused"] >= cache["kv_warmed_tokens"]
    assert hot["usage"]["input_tokens"] - cache["kv_tokens_reused"] < 24  # the question's words
    assert cold_done["visiongate"]["cache"]["kv_warmed_tokens"] == 0
    assert cold_done["visiongate"]["cache"]["kv_tokens_reused"] == 0
