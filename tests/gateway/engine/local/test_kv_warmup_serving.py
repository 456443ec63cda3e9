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
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.server.app import create_app
from gateway.server.runner import ServerThread
from gateway.testing.realtime_peer import Peer, data_url, deltas
from tests.conftest import photo_bytes
from tests.gateway.conftest import gateway_settings

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


def _http_turns(server: ServerThread, *, upload_ahead: bool) -> dict[str, Any]:
    """A chat session over HTTP: a text turn, then POST /v1/images (with the session's id when
    `upload_ahead`), then a turn that sends the photo by reference and its question in one
    user message; the second turn's answer."""
    session_id = f"warm-http-{uuid.uuid4().hex[:8]}"
    with httpx.Client(base_url=server.http_url, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": "Hello! I am about to send you a photo."},
        ]
        body = {"model": model, "max_tokens": MAX_TOKENS, "session_id": session_id}
        first = client.post("/v1/chat/completions", json={**body, "messages": messages})
        assert first.status_code == 200, first.text
        messages.append(
            {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}
        )
        before = _warmed(server)
        headers = {"Content-Type": "image/png"}
        if upload_ahead:
            headers["X-Session-Id"] = session_id
        uploaded = client.post("/v1/images", content=_photo(), headers=headers)
        assert uploaded.status_code == 200, uploaded.text
        if upload_ahead:
            deadline = time.monotonic() + 120
            while _warmed(server) <= before:
                assert time.monotonic() < deadline, "no warm-up was counted"
                time.sleep(0.1)
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": uploaded.json()["ref"]}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        )
        answer = client.post("/v1/chat/completions", json={**body, "messages": messages})
        assert answer.status_code == 200, answer.text
        return answer.json()


async def test_image_uploaded_ahead_warms_the_http_turn(gateways) -> None:
    warm, cold = gateways
    hot = await asyncio.to_thread(_http_turns, warm, upload_ahead=True)
    plain = await asyncio.to_thread(_http_turns, cold, upload_ahead=False)
    assert hot["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert hot["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    ext = hot["usage"]["visiongate"]
    assert ext["cache"]["kv_warmed_tokens"] > ext["image_tokens"]
    assert hot["usage"]["prompt_tokens"] - ext["cache"]["kv_tokens_reused"] < 24
    # the second turn reuses the first either way; only a warmed one reuses the photo too
    assert plain["usage"]["visiongate"]["cache"]["kv_warmed_tokens"] == 0
    assert (
        plain["usage"]["visiongate"]["cache"]["kv_tokens_reused"] < ext["cache"]["kv_tokens_reused"]
    )
