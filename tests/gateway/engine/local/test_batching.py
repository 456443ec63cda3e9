"""Many sessions at once over real servers and the real model: continuous batching keeps every
answer exactly what it would be alone, cancel and preemption leave the others untouched, a full
queue is refused with `busy` / 429, and prefix caching serves the stateless OpenAI pattern."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from gateway.server.app import create_app
from gateway.server.runner import ServerThread
from gateway.testing.realtime_peer import Peer, data_url, deltas
from tests.conftest import photo_bytes
from tests.gateway.conftest import gateway_settings, gateway_state

pytestmark = pytest.mark.slow

# the batch runs one key a session: sessions of one key may share the cached KV of their
# common prefix (the system prompt's first tokens), which would blur what the test checks
BATCH_KEYS = [f"key-batch-{i}" for i in range(8)]
KEYS = ["key-alone", "key-other", *BATCH_KEYS]
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "Write one sentence about the sea.",
    "What do bees make?",
    "Count from one to five in words.",
    "Describe a cat in one sentence.",
]


@pytest.fixture(scope="module")
def batch_server() -> Iterator[ServerThread]:
    """Batching on, API keys so that runs under different keys never share cached KV."""
    settings = gateway_settings(api_keys=KEYS, engine_max_batch=8)
    with ServerThread(create_app(settings), settings) as server:
        server.wait_ready()
        yield server


class Watch:
    """Samples the engine's scheduler gauges while a test runs."""

    def __init__(self, server: ServerThread) -> None:
        self.engine = gateway_state(server).engine
        self.max_batch = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.max_batch = max(self.max_batch, self.engine.stats().batch_size)
            time.sleep(0.005)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def open_peer(server: ServerThread, key: str) -> Peer:
    return await Peer.open(server.ws_url, api_key=key, key_in="header")


STORIES = [
    "Tell me a long story about a dragon who learns to bake bread.",
    "Write a long, detailed story about a lighthouse keeper and a storm.",
    "Tell a long story about two friends crossing a desert.",
    "Write a long fairy tale about a clockmaker's lost key.",
]


def prompt_parts(i: int) -> list[dict]:
    if i >= 100:  # long answers
        return [{"type": "input_text", "text": STORIES[i - 100]}]
    parts: list[dict] = [{"type": "input_text", "text": QUESTIONS[i % len(QUESTIONS)]}]
    if i in (1, 5):  # two sessions bring a photo: an image prefill in the mix
        photo = photo_bytes(("chelsea", "coffee")[i == 5], size=224)
        parts.insert(0, {"type": "input_image", "image_url": data_url(photo)})
    return parts


async def ask(
    server: ServerThread,
    key: str,
    i: int,
    *,
    max_tokens: int = 24,
    cancel_after_first: bool = False,
) -> tuple[str, dict]:
    peer = await open_peer(server, key)
    try:
        await peer.send({"type": "session.update", "session": {"instructions": f"Be brief. #{i}"}})
        await peer.until("session.updated")
        await peer.add(prompt_parts(i))
        await peer.until("conversation.item.done")
        await peer.send({"type": "response.create", "response": {"max_output_tokens": max_tokens}})
        if cancel_after_first:
            await peer.until("response.output_text.delta")
            await peer.send({"type": "response.cancel"})
        done, before = await peer.until("response.done")
        return deltas(before), done["response"]
    finally:
        await peer.close()


async def test_batch_of_eight_is_token_identical_to_alone(batch_server: ServerThread) -> None:
    alone = [await ask(batch_server, "key-alone", i) for i in range(8)]
    with Watch(batch_server) as watch:
        together = await asyncio.gather(*(ask(batch_server, BATCH_KEYS[i], i) for i in range(8)))
    assert watch.max_batch >= 4, "the eight sessions never ran in one batch"
    for i, ((text_a, resp_a), (text_b, resp_b)) in enumerate(zip(alone, together, strict=False)):
        assert text_a and text_a == text_b, f"session {i} changed in a batch"
        assert resp_a["usage"]["output_tokens"] == resp_b["usage"]["output_tokens"]
        # another key's KV was never reused: each session prefilled its prompt itself (or its
        # own KV warm-up did, between the photo's item and the response)
        cached = resp_b["usage"]["input_token_details"]["cached_tokens"]
        assert cached == resp_b["visiongate"]["cache"]["kv_warmed_tokens"]


async def test_cancelling_one_of_eight_leaves_the_others_unchanged(batch_server) -> None:
    alone = [await ask(batch_server, "key-alone", i, max_tokens=32) for i in range(8)]
    runs = [
        ask(batch_server, "key-other", i, max_tokens=32, cancel_after_first=(i == 3))
        for i in range(8)
    ]
    together = await asyncio.gather(*runs)
    assert together[3][1]["status"] == "cancelled"
    assert together[3][1]["usage"]["output_tokens"] < alone[3][1]["usage"]["output_tokens"]
    for i in range(8):
        if i != 3:
            assert together[i][0] == alone[i][0], f"session {i} changed when 3 was cancelled"
            assert together[i][1]["status"] == alone[i][1]["status"]


@pytest.fixture(scope="module")
def tiny_queue_server() -> Iterator[ServerThread]:
    settings = gateway_settings(engine_max_batch=1, engine_max_queue=1, prefill_chunk_tokens=64)
    with ServerThread(create_app(settings), settings) as server:
        server.wait_ready()
        yield server


async def test_full_queue_answers_busy_and_http_429(tiny_queue_server: ServerThread) -> None:
    server = tiny_queue_server
    peers = [await Peer.open(server.ws_url) for _ in range(3)]
    # the running answer must outlast the checks below: this list runs to its token limit (a
    # short answer ending early would free the queue slot mid-test)
    texts = ["List the numbers from 1 to 100 separated by commas.", *QUESTIONS[1:3]]
    try:
        for text, peer in zip(texts, peers, strict=True):
            await peer.add([{"type": "input_text", "text": text}])
            await peer.until("conversation.item.done")
        await peers[0].send({"type": "response.create", "response": {"max_output_tokens": 160}})
        await peers[0].until("response.output_text.delta")  # running
        await peers[1].send({"type": "response.create", "response": {"max_output_tokens": 4}})
        await asyncio.sleep(0.3)  # waiting: the one queue slot is taken
        await peers[2].send(
            {
                "type": "response.create",
                "event_id": "evt-full",
                "response": {"max_output_tokens": 4},
            }
        )
        done, seen = await peers[2].until("response.done")
        errors = [e for e in seen if e["type"] == "error"]
        assert done["response"]["status"] == "failed"
        assert done["response"]["status_details"]["error"]["code"] == "busy"
        assert not errors or errors[0]["error"]["code"] == "busy"

        async with httpx.AsyncClient(base_url=server.http_url, timeout=60) as client:
            r = await client.post(
                "/v1/chat/completions",
                json={
                    "model": gateway_state(server).engine.model_id,
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": "Hello"}],
                },
            )
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "busy"

        # the running and the queued answers still complete
        first, _ = await peers[0].until("response.done")
        second, _ = await peers[1].until("response.done")
        assert first["response"]["status"] == "incomplete"  # the list ran to its limit
        assert second["response"]["status"] in ("completed", "incomplete")
    finally:
        for peer in peers:
            await peer.close()


@pytest.fixture(scope="module")
def small_kv_server() -> Iterator[ServerThread]:
    """A KV budget that holds two short conversations' prompts but not their growth."""
    settings = gateway_settings(kv_budget_bytes=12 * 1024 * 1024, engine_max_batch=8)
    with ServerThread(create_app(settings), settings) as server:
        server.wait_ready()
        yield server


async def test_small_kv_budget_preempts_and_answers_stay_identical(
    small_kv_server: ServerThread, gateway_server: ServerThread
) -> None:
    questions = [100, 101, 102, 103]
    # the reference runs batched on an ample budget (a batch answers as each request alone
    # would: test_batch_of_eight_is_token_identical_to_alone)
    reference = await asyncio.gather(
        *(ask(gateway_server, "", i, max_tokens=72) for i in questions)
    )
    engine = gateway_state(small_kv_server).engine
    before = engine.stats().preemptions_total
    constrained = await asyncio.gather(
        *(ask(small_kv_server, "", i, max_tokens=72) for i in questions)
    )
    assert engine.stats().preemptions_total > before, "the budget never forced a preemption"
    for (text_ref, resp_ref), (text, resp) in zip(reference, constrained, strict=False):
        assert resp["status"] == resp_ref["status"]
        assert text == text_ref
    assert max(r["usage"]["output_tokens"] for _, r in constrained) > 48


def test_stateless_http_conversation_reuses_previous_turns(gateway_server: ServerThread) -> None:
    """The full history sent again each turn, no session id: every previous turn is cached."""
    client = OpenAI(base_url=gateway_server.http_url + "/v1", api_key="unused")
    model = gateway_state(gateway_server).engine.model_id
    messages = [
        {"role": "system", "content": "You answer in one short sentence. #stateless"},
        {"role": "user", "content": "What is the largest planet?"},
    ]
    previous = None
    for follow_up in ("And the smallest?", "Which one has rings?", None):
        done = client.chat.completions.create(model=model, messages=messages, max_tokens=16)
        usage = done.usage
        cached = usage.prompt_tokens_details.cached_tokens
        if previous is None:  # at most the chat template's head, shared with earlier tests
            assert cached < usage.prompt_tokens // 2
        else:
            # the previous prompt and every answer token that went through the model
            assert cached >= previous.prompt_tokens + previous.completion_tokens - 3
            assert cached < usage.prompt_tokens
        previous = usage
        if follow_up is None:
            break
        messages += [
            {"role": "assistant", "content": done.choices[0].message.content},
            {"role": "user", "content": follow_up},
        ]
