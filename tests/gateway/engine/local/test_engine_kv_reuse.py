"""KV reuse on the real model: sessions, automatic prefix caching, content checks, Redis spill.

Each request's prefix-cache namespace (`cache_salt`) is its session id here, and a fresh one
for the "uncached" reference runs, so reuse is only what a test sets up.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from gateway.engine.interface import GenerationRequest, ImageInput, Message, SamplingParams
from gateway.engine.local.kv.redis_store import RedisKVStore
from gateway.engine.local.prompt import render

pytestmark = pytest.mark.slow

SYSTEM = Message("system", ["You are a concise geography tutor."])


def request(
    messages: list[Message], kv_key: str | None, max_tokens: int = 16, salt: str | None = None
) -> GenerationRequest:
    return GenerationRequest(
        "kv",
        messages,
        SamplingParams(max_output_tokens=max_tokens),
        kv_key=kv_key,
        cache_salt=salt or kv_key or uuid.uuid4().hex,
    )


def image(engine, seed: int, digest: str, n: int = 12) -> ImageInput:
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(n, engine.hidden_size, generator=g)  # [N, H]
    embeds = embeds / embeds.pow(2).mean(dim=-1, keepdim=True).sqrt() * engine.embedding_rms
    return ImageInput(digest=digest, embeds=embeds)


def history_length(engine, messages: list[Message]) -> int:
    """Positions of `messages` rendered as history (what a next turn starts with)."""
    return render(engine.tokenizer, messages, add_generation_prompt=False).length


def reused_after(engine, history: list[Message], turn1) -> int:
    """What the next turn reuses of `history` (ending in turn 1's answer): every position that
    went through the model. The last sampled token and the end-of-turn tokens after the answer
    (`<|im_end|>` and a newline) are prefilled with the next turn's words."""
    tail = 2 if turn1.finish_reason == "stop" else 3
    return history_length(engine, history) - tail


async def two_turns(engine, collect, kv_key: str, first: list[Message], follow_up: str):
    _, turn1 = await collect(engine, request(first, kv_key))
    second = [*first, Message("assistant", [turn1.text]), Message("user", [follow_up])]
    _, turn2 = await collect(engine, request(second, kv_key))
    return turn1, turn2, second


async def test_turn_two_reuses_all_of_turn_one(engine, collect) -> None:
    first = [SYSTEM, Message("user", ["What is the capital of France?"])]
    turn1, turn2, second = await two_turns(engine, collect, "s-full", first, "And of Italy?")
    assert turn1.cached_tokens == 0
    covered = reused_after(engine, [*first, Message("assistant", [turn1.text])], turn1)
    # turn 1's prompt and every answer token that went through the model
    assert covered == turn1.input_tokens + turn1.output_tokens - 1
    assert turn2.cached_tokens == covered
    assert turn2.cached_tokens < turn2.input_tokens
    _, uncached = await collect(engine, request(second, None))
    assert uncached.cached_tokens == 0
    assert turn2.text == uncached.text  # reuse changes speed, never the answer
    assert turn2.input_tokens == uncached.input_tokens


async def test_length_and_stop_answers_are_reused_too(engine, collect) -> None:
    first = [SYSTEM, Message("user", ["Tell me about the river Nile."])]
    _, turn1 = await collect(engine, request(first, "s-length", max_tokens=5))
    assert turn1.finish_reason == "length"
    second = [*first, Message("assistant", [turn1.text]), Message("user", ["Go on."])]
    _, turn2 = await collect(engine, request(second, "s-length", max_tokens=8))
    assert turn2.cached_tokens == reused_after(engine, second[:3], turn1)
    _, uncached = await collect(engine, request(second, None, max_tokens=8))
    assert turn2.text == uncached.text


async def test_edited_history_reuses_only_the_common_prefix(engine, collect) -> None:
    first = [SYSTEM, Message("user", ["What is the capital of Spain?"])]
    _turn1, _, _ = await two_turns(engine, collect, "s-edit", first, "Thanks.")
    edited = [SYSTEM, Message("user", ["What is the capital of Portugal?"])]
    _, turn3 = await collect(engine, request(edited, "s-edit"))
    system_len = history_length(engine, [SYSTEM])
    assert system_len <= turn3.cached_tokens < turn3.input_tokens - 2
    _, uncached = await collect(engine, request(edited, None))
    assert turn3.text == uncached.text


async def test_changed_image_invalidates_from_its_block(engine, collect) -> None:
    photo_a = image(engine, 1, "a" * 64)
    photo_b = image(engine, 2, "b" * 64)
    first = [SYSTEM, Message("user", ["Here is a photo.", photo_a, "What do you see?"])]
    turn1, turn2, second = await two_turns(engine, collect, "s-img", first, "Is it outdoors?")
    assert turn2.cached_tokens == reused_after(engine, second[:3], turn1)  # same image: all reused
    assert turn2.image_tokens == 12

    swapped = [
        SYSTEM,
        Message("user", ["Here is a photo.", photo_b, "What do you see?"]),
        *second[2:],
    ]
    _, turn3 = await collect(engine, request(swapped, "s-img"))
    image_start = render(engine.tokenizer, swapped, add_generation_prompt=True).images[0].start
    assert 0 < turn3.cached_tokens <= image_start
    _, uncached = await collect(engine, request(swapped, None))
    assert turn3.text == uncached.text

    # same digest, different embeddings (another encoder config): not reused either
    regenerated = ImageInput("b" * 64, photo_b.embeds * 0.5)
    again = [
        SYSTEM,
        Message("user", ["Here is a photo.", regenerated, "What do you see?"]),
        *second[2:],
    ]
    _, turn4 = await collect(engine, request(again, "s-img"))
    assert turn4.cached_tokens <= image_start


async def test_namespaces_do_not_share_kv(engine, collect) -> None:
    first = [SYSTEM, Message("user", ["Name a large desert."])]
    await collect(engine, request(first, "s-owner", salt="key-a"))
    _, other = await collect(engine, request(first, "s-other", salt="key-b"))
    assert other.cached_tokens == 0
    _, same_key = await collect(engine, request(first, "s-third", salt="key-a"))
    assert same_key.cached_tokens == same_key.input_tokens - 1  # one key's sessions share blocks


async def test_stateless_history_resent_reuses_previous_turns(engine, collect) -> None:
    """The OpenAI SDK pattern: no session, the whole history sent again every turn."""
    salt = uuid.uuid4().hex
    messages = [SYSTEM, Message("user", ["What is the capital of Peru?"])]
    _, turn1 = await collect(engine, request(messages, None, salt=salt))
    assert turn1.cached_tokens == 0
    for follow_up in ("And of Chile?", "And of Bolivia?"):
        previous = turn1
        messages = [*messages, Message("assistant", [previous.text]), Message("user", [follow_up])]
        _, turn = await collect(engine, request(messages, None, salt=salt))
        assert turn.cached_tokens == reused_after(engine, messages[:-1], previous)
        _, uncached = await collect(engine, request(messages, None))
        assert turn.text == uncached.text
        turn1 = turn


async def test_redis_spill_continues_on_another_replica(engine, collect, redis_url: str) -> None:
    first = [SYSTEM, Message("user", ["What is the capital of Germany?"])]
    replica_a = engine.replica(kv_spill_redis_url=redis_url)
    replica_b = engine.replica(kv_spill_redis_url=redis_url)
    await replica_a.start()
    await replica_b.start()
    try:
        _, turn1 = await collect(replica_a, request(first, "s-redis"))
        assert isinstance(replica_a.kv_store, RedisKVStore)
        assert await replica_a.flush_kv()
        second = [*first, Message("assistant", [turn1.text]), Message("user", ["And of Austria?"])]
        _, turn2 = await collect(replica_b, request(second, "s-redis"))  # nothing in b's memory
        assert turn2.cached_tokens == reused_after(engine, second[:3], turn1)
        _, uncached = await collect(engine, request(second, None))
        assert turn2.text == uncached.text
    finally:
        await replica_a.aclose()
        await replica_b.aclose()


async def test_evicted_session_reloads_from_redis(engine, collect, redis_url: str) -> None:
    # the prefix cache keeps nothing, and the spill store keeps nothing in the process
    tiny = engine.replica(kv_spill_redis_url=redis_url, kv_budget_bytes=1)
    await tiny.start()
    try:
        first = [SYSTEM, Message("user", ["What is the capital of Japan?"])]
        _, turn1 = await collect(tiny, request(first, "s-evict"))
        assert await tiny.flush_kv()
        second = [*first, Message("assistant", [turn1.text]), Message("user", ["And of China?"])]
        _, turn2 = await collect(tiny, request(second, "s-evict"))
        assert turn2.cached_tokens == reused_after(engine, second[:3], turn1)
    finally:
        await tiny.aclose()
