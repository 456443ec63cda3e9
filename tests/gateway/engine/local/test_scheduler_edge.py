"""The continuous-batching engine under hostile and edge-case input, on the real model.

Each test holds one property a serving engine must keep whatever a client sends: a bad request
is refused with a stable code before it runs, it never takes the batch (or the scheduler
thread) down with it, it never leaves KV in the prefix cache that later requests would reuse,
and memory, closing and queueing keep their contracts at their edges. Requests that compare
answers use distinct `cache_salt` values, so the prefix cache is controlled, not incidental.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from gateway.engine.interface import (
    EngineError,
    GenerationRequest,
    GenerationResult,
    ImageInput,
    Message,
    SamplingParams,
    TextDelta,
)
from gateway.engine.local.kv.blocks import block_hashes, chain_seed, position_keys
from gateway.engine.local.kv.prefix_cache import PrefixCache
from gateway.engine.local.local_engine import LocalEngine
from gateway.engine.local.weights import DEFAULT_MODEL_ID, ensure_default_converted
from gateway.testing.engine_requests import text_requests

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
STORY = "Write a long story about a dragon who lives in a castle."


ask = text_requests("edge", max_tokens=8)


def with_image(embeds: torch.Tensor, salt: str, digest: str = "e" * 64) -> GenerationRequest:
    return GenerationRequest(
        f"edge-img-{time.monotonic_ns()}",
        [Message("user", ["Look at this.", ImageInput(digest, embeds)])],
        SamplingParams(max_output_tokens=4),
        cache_salt=salt,
    )


async def refusal(engine, request: GenerationRequest) -> EngineError:
    """Run a request that must be refused; return the error (it must come before any text)."""
    with pytest.raises(EngineError) as info:
        async for item in engine.generate(request):
            assert not isinstance(item, TextDelta), "a refused request streamed text"
    return info.value


# -- bad input is refused before it runs ---------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
async def test_non_finite_image_embeds_are_refused_and_never_cached(engine, collect, bad) -> None:
    # A NaN row spreads to every position of its prefill chunk (0 * NaN in attention), the
    # system prompt included: cached, those blocks would answer garbage to every later request
    # of the namespace that starts the same way.
    salt = f"non-finite-{bad}"
    _, reference = await collect(engine, ask(QUESTION, salt=f"{salt}-reference"))
    embeds = torch.zeros(4, engine.hidden_size)
    embeds[1, 7] = bad
    error = await refusal(engine, with_image(embeds, salt))
    assert error.code == "invalid_image"
    _, after = await collect(engine, ask(QUESTION, salt=salt))
    assert after.text == reference.text


async def test_integer_image_embeds_are_refused(engine) -> None:
    embeds = torch.ones(3, engine.hidden_size, dtype=torch.int64)
    error = await refusal(engine, with_image(embeds, "int-embeds"))
    assert error.code == "invalid_image"
    assert "float" in str(error)


@pytest.mark.parametrize(
    "sampling",
    [
        {"top_p": 0.0, "temperature": 1.0},
        {"top_p": 1.5},
        {"top_p": float("nan"), "temperature": 1.0},
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"temperature": 0.7, "seed": 2**64},
    ],
    ids=[
        "top_p=0",
        "top_p>1",
        "top_p=nan",
        "temperature<0",
        "temperature=nan",
        "temperature=inf",
        "seed>64bit",
    ],
)
async def test_sampling_out_of_range_is_refused_and_spares_the_batch(
    engine, collect, sampling
) -> None:
    # top_p=0 and a NaN temperature used to reach torch.multinomial, whose error failed every
    # sequence of the step, not only the one that asked for it
    _, reference = await collect(engine, ask(QUESTION, salt="sampling-reference"))
    good, bad = await asyncio.gather(
        collect(engine, ask(QUESTION, salt=f"sampling-good-{sampling}")),
        refusal(engine, ask("Hi", 4, **sampling)),
        return_exceptions=True,
    )
    assert isinstance(bad, EngineError) and bad.code == "invalid_request", bad
    assert not isinstance(good, BaseException), good
    assert good[1].text == reference.text


@pytest.mark.parametrize("max_tokens", [0, -3])
async def test_max_output_tokens_below_one_is_refused(engine, max_tokens) -> None:
    # it used to be served as max_output_tokens=1
    error = await refusal(engine, ask(QUESTION, max_tokens))
    assert error.code == "invalid_request"
    assert "max_output_tokens" in str(error)


async def test_stop_strings_that_cost_per_token_are_refused(engine) -> None:
    # the stop check rescans each stop's prefixes against the text every token: four 20k-char
    # stops cost ~11 s of the scheduler thread over 2000 tokens, stalling every stream
    long_stop = await refusal(engine, ask(QUESTION, stop=("x" * 257,)))
    assert long_stop.code == "invalid_request"
    many = await refusal(engine, ask(QUESTION, stop=tuple(f"s{i}" for i in range(5))))
    assert many.code == "invalid_request"


async def test_stop_string_matching_the_first_token_ends_at_once(engine, collect) -> None:
    _, full = await collect(engine, ask(QUESTION, salt="stop-first"))
    first_word = full.text.split()[0]
    deltas, result = await collect(engine, ask(QUESTION, salt="stop-first", stop=(first_word,)))
    assert deltas == [] and result.text == ""
    assert result.finish_reason == "stop" and result.output_tokens == 1


async def test_empty_conversation_is_invalid_request(engine) -> None:
    error = await refusal(engine, GenerationRequest("empty", [], SamplingParams()))
    assert error.code == "invalid_request"


# -- one request's failure stays its own ---------------------------------------------------------


async def test_near_zero_temperature_is_greedy_and_spares_the_batch(engine, collect) -> None:
    # temperature 1e-40 is inside every API's [0, 2]; logits / 1e-40 overflowed to inf, softmax
    # gave NaN, and multinomial's error failed the whole step (the greedy neighbour included)
    _, reference = await collect(engine, ask(QUESTION, 12, salt="tiny-t-reference"))
    greedy, tiny = await asyncio.gather(
        collect(engine, ask(QUESTION, 12, salt="tiny-t-greedy")),
        collect(engine, ask(QUESTION, 12, salt="tiny-t", temperature=1e-40, seed=3)),
    )
    assert greedy[1].text == reference.text
    assert tiny[1].text == reference.text


async def test_a_sequence_turning_non_finite_fails_alone_and_is_not_cached(engine, collect) -> None:
    # What a numerically unstable forward looks like (fp16 overflow): the image rows turn NaN
    # after the request was checked, while its prompt is still being prefilled in chunks.
    # Greedy decoding used to sample garbage from NaN logits and cache the NaN KV under the
    # image's key, so every later request with that image got it.
    twin = engine.replica(max_batch=2, prefill_chunk_tokens=16)
    await twin.start()
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(32, engine.hidden_size, generator=g) * 0.05  # [32, H]
    text = "Here is a long description before the picture. " * 12

    def looking(embeds: torch.Tensor, salt: str) -> GenerationRequest:
        image = ImageInput("f" * 64, embeds)
        return GenerationRequest(
            f"edge-unstable-{time.monotonic_ns()}",
            [Message("user", [text, image, "What is it?"])],
            SamplingParams(max_output_tokens=6),
            cache_salt=salt,
        )

    try:
        _, reference = await collect(twin, looking(rows.clone(), "unstable-reference"))
        unstable = rows.clone()
        task = asyncio.create_task(collect(twin, looking(unstable, "unstable")))
        while twin.stats().running == 0:  # checked and admitted: the image is not fed yet
            await asyncio.sleep(0.001)
        unstable.fill_(float("nan"))
        neighbour = await collect(twin, ask(QUESTION, 6, salt="unstable-neighbour"))
        with pytest.raises(EngineError) as info:
            await task
        assert "non-finite" in str(info.value)
        _, alone = await collect(twin, ask(QUESTION, 6, salt="unstable-alone"))
        assert neighbour[1].text == alone.text
        _, after = await collect(twin, looking(rows.clone(), "unstable"))
        assert after.text == reference.text
    finally:
        await twin.aclose()


async def test_non_finite_kv_of_a_cancelled_prefill_is_not_cached(engine, collect) -> None:
    # the same instability, but the request is cancelled after its NaN rows were fed and before
    # any logits: what it computed is published on the way out, and must not reach the cache
    twin = engine.replica(max_batch=2, prefill_chunk_tokens=16)
    await twin.start()
    sched = twin._scheduler
    g = torch.Generator().manual_seed(6)
    rows = torch.randn(16, engine.hidden_size, generator=g) * 0.05  # [16, H]
    after_text = "Now read this long note after the picture, every word of it. " * 12

    def looking(embeds: torch.Tensor, salt: str) -> GenerationRequest:
        image = ImageInput("c" * 64, embeds)
        return GenerationRequest(
            f"edge-cancelled-{time.monotonic_ns()}",
            [Message("user", ["A picture:", image, after_text])],
            SamplingParams(max_output_tokens=4),
            cache_salt=salt,
        )

    try:
        _, reference = await collect(twin, looking(rows.clone(), "cancelled-reference"))
        unstable = rows.clone()
        request = looking(unstable, "cancelled")
        task = asyncio.create_task(collect(twin, request))
        while not sched.admission.running:
            await asyncio.sleep(0.001)
        unstable.fill_(float("nan"))
        seq = sched.admission.running[0]
        image_end = seq.prompt.images[0].start + seq.prompt.images[0].length
        while seq.fed < image_end + 16:  # NaN rows fed (and spread), the prompt not finished
            await asyncio.sleep(0.001)
        assert seq.fed < seq.prompt.length
        request.cancel.set()
        _, cancelled = await task
        assert cancelled.finish_reason == "cancelled" and cancelled.output_tokens == 0
        _, after = await collect(twin, looking(rows.clone(), "cancelled"))
        assert after.text == reference.text
    finally:
        await twin.aclose()


async def test_a_failing_call_between_steps_does_not_stop_the_engine(engine, collect) -> None:
    # calls queued for the loop thread (forget, cache clears) ran outside the step's error
    # handling: one exception ended the thread and every request after it waited forever
    twin = engine.replica()
    await twin.start()
    try:
        twin.forget(["not", "a", "key"])  # type: ignore[arg-type]  # unhashable: raises there
        _, result = await asyncio.wait_for(collect(twin, ask(QUESTION, 4)), 60)
        assert result.output_tokens > 0
        assert await twin.flush_kv(10.0)
    finally:
        await asyncio.wait_for(twin.aclose(), 30)


async def test_many_tiny_requests_with_control_calls_from_another_thread(engine, collect) -> None:
    # stats, forget and flush_kv arrive from other threads (metrics, session deletes) while
    # sequences join and leave every step: every request still ends exactly once
    twin = engine.replica(max_batch=16, max_queue=128)
    await twin.start()
    stop = threading.Event()
    failures: list[BaseException] = []

    def poke() -> None:
        i = 0
        while not stop.is_set():
            try:
                twin.stats()
                twin.forget(f"edge-session-{i % 7}")
                i += 1
            except BaseException as exc:  # any escape is the finding
                failures.append(exc)
            time.sleep(0.0005)

    poker = threading.Thread(target=poke, daemon=True)
    poker.start()
    try:
        requests = []
        for i in range(64):
            request = ask(f"Say {i}.", 1 + i % 3, salt=f"tiny-{i % 4}")
            request.kv_key = f"edge-session-{i % 7}"
            requests.append(request)
        results = await asyncio.wait_for(asyncio.gather(*[collect(twin, r) for r in requests]), 300)
        assert await twin.flush_kv(10.0)
    finally:
        stop.set()
        poker.join()
        await twin.aclose()
    assert failures == []
    for i, (deltas, result) in enumerate(results):
        limit = 1 + i % 3
        assert 1 <= result.output_tokens <= limit
        if result.finish_reason == "length":
            assert result.output_tokens == limit
        else:
            assert result.finish_reason == "stop"
        assert "".join(deltas) == result.text
    assert twin.stats().running == 0


# -- memory and lifecycle at their edges ----------------------------------------------------------


async def test_zero_kv_budget_serves_one_at_a_time(engine, collect) -> None:
    twin = engine.replica(kv_budget_bytes=0, max_batch=4, prefill_chunk_tokens=64)
    await twin.start()
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*[collect(twin, ask(f"Say {i}.", 3)) for i in range(3)]), 120
        )
        assert [r.finish_reason for _, r in results] == ["length"] * 3
        assert twin._scheduler.kv.cached_bytes == 0  # nothing outlives its request
    finally:
        await twin.aclose()


async def test_prompt_over_the_budget_runs_alone_and_the_budget_holds(engine, collect) -> None:
    budget = engine._scheduler.kv.pos_bytes * 300  # ~300 positions; the long prompt needs ~700
    twin = engine.replica(kv_budget_bytes=budget, max_batch=4, prefill_chunk_tokens=64)
    await twin.start()
    sched = twin._scheduler
    over: list[float] = []
    stop = threading.Event()

    def watch() -> None:  # while two or more run, their buffers and the cache fit the budget
        while not stop.is_set():
            running = list(sched.admission.running)
            if len(running) > 1:
                held = sum(kv.nbytes for s in running if (kv := s.kv) is not None)
                if held + sched.kv.cached_bytes > budget:
                    over.append((held + sched.kv.cached_bytes) / sched.kv.pos_bytes)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        small = [collect(twin, ask(f"Count to {i + 3} in words.", 24)) for i in range(3)]
        huge = collect(twin, ask("word " * 600 + "How many words?", 4))
        results = await asyncio.wait_for(asyncio.gather(*small, huge), 300)
    finally:
        stop.set()
        watcher.join()
        await twin.aclose()
    assert all(r.finish_reason in ("stop", "length") for _, r in results)
    assert results[-1][1].input_tokens > 600
    assert over == []


async def test_aclose_ends_waiting_and_running_requests(engine, collect) -> None:
    twin = engine.replica(max_batch=2, max_queue=8)
    await twin.start()
    tasks = [asyncio.create_task(collect(twin, ask(STORY, 200))) for _ in range(5)]
    while twin.stats().running < 2:
        await asyncio.sleep(0.05)
    await asyncio.wait_for(twin.aclose(), 30)
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    assert all(isinstance(o, EngineError) and o.code == "closed" for o in outcomes), outcomes
    late = await refusal(twin, ask(QUESTION))
    assert late.code == "not_ready"
    assert twin.stats().running == 0


async def test_seeded_sampling_is_the_same_alone_and_in_a_batch(engine, collect) -> None:
    def seeded(salt: str) -> GenerationRequest:
        return ask(STORY, 16, salt=salt, temperature=0.9, top_p=0.95, seed=77)

    _, alone = await collect(engine, seeded("seeded-alone"))
    batch = await asyncio.gather(
        collect(engine, seeded("seeded-a")),
        collect(engine, ask(QUESTION, 16, salt="seeded-b")),
        collect(engine, seeded("seeded-c")),
    )
    assert batch[0][1].text == alone.text == batch[2][1].text
    assert isinstance(batch[1][1], GenerationResult)


# -- KV shared through Redis -------------------------------------------------------------------


@pytest.fixture(scope="module")
def retrained_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model with one attention projection changed, in a directory of the same name
    (a new fine-tune deployed at the same path): same model id, same dtype, other KV."""
    from safetensors.torch import load_file, save_file

    source = ensure_default_converted()
    target = tmp_path_factory.mktemp("deploy") / DEFAULT_MODEL_ID
    target.mkdir()
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, target / file.name)
    tensors = load_file(source / "model.safetensors")
    key = next(k for k in tensors if k.endswith("layers.0.self_attn.k_proj.weight"))
    tensors[key] = tensors[key] * 1.25
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


async def test_spilled_kv_is_read_only_by_the_same_weights(
    engine, collect, redis_url: str, retrained_checkpoint: Path
) -> None:
    # the spill seed named the model id and dtype only: a replica serving other weights under
    # the same name loaded the session's KV from Redis and continued from it
    def turn(messages: list[Message]) -> GenerationRequest:
        return GenerationRequest(
            f"edge-spill-{time.monotonic_ns()}",
            messages,
            SamplingParams(max_output_tokens=8),
            kv_key="s-weights",
            cache_salt="weights",
        )

    writer = engine.replica(kv_spill_redis_url=redis_url)
    same = engine.replica(kv_spill_redis_url=redis_url)
    other = LocalEngine(model_path=str(retrained_checkpoint), kv_spill_redis_url=redis_url)
    for e in (writer, same, other):
        await e.start()
    try:
        assert other.model_id == writer.model_id
        first = [Message("user", ["What is the capital of Germany?"])]
        _, turn1 = await collect(writer, turn(first))
        assert await writer.flush_kv()
        second = [*first, Message("assistant", [turn1.text]), Message("user", ["And of Austria?"])]
        _, on_other = await collect(other, turn(second))
        assert on_other.cached_tokens == 0
        _, on_same = await collect(same, turn(second))  # the control: same weights reuse it
        assert on_same.cached_tokens > 0
    finally:
        for e in (writer, same, other):
            await e.aclose()


# -- the prefix cache's books, without the model -------------------------------------------------


def test_prefix_cache_books_stay_true_under_random_traffic() -> None:
    # inserts, lookups, pins, forgets and evictions over two namespaces, with a tiny alphabet so
    # prefixes, partial tails and superseded tails collide all the time; after every operation
    # the byte count, the parent index, the pin counts and every match must agree with the blocks
    bs, rng = 4, random.Random(0)
    seeds = [chain_seed("m", f"float32|{salt}", bs) for salt in ("a", "b")]
    cache = PrefixCache(bs)

    def content(seed: bytes, keys: list) -> float:  # what a position's KV "is": its whole prefix
        return float(hash((seed, tuple(keys))) % 1009)

    for _ in range(5000):
        seed = rng.choice(seeds)
        tokens = [rng.randint(0, 2) for _ in range(rng.randint(1, 14))]
        keys, hashes = position_keys(tokens, []), block_hashes(tokens, [], bs, seed)
        op = rng.random()
        if op < 0.45:
            layer = torch.tensor([content(seed, keys[: i + 1]) for i in range(len(keys))])
            layers = [layer.view(1, 1, -1, 1).expand(2, 1, -1, 1)] * 2  # [2, Hkv, n, D] x 2
            kept = cache.insert(seed, keys, hashes, layers, len(keys))
            if rng.random() < 0.3:
                cache.pin(f"s{rng.randint(0, 5)}", kept)
        elif op < 0.8:
            found, at = cache.match(seed, keys, hashes, len(keys)), 0
            for block, n in found.blocks:  # reused KV is exactly this sequence's
                want = [content(seed, keys[: at + i + 1]) for i in range(n)]
                assert block.kv[0, 0, 0, :n, 0].tolist() == want
                at += n
        elif op < 0.9:
            cache.shrink(rng.randint(0, cache.nbytes), unpin=rng.random() < 0.5)
        else:
            cache.forget(f"s{rng.randint(0, 5)}")
        blocks = cache._blocks
        assert cache.nbytes == sum(b.nbytes for b in blocks.values())
        for key, block in blocks.items():
            assert cache._children[block.parent][key] is block
            assert block.parent in seeds or block.parent in blocks  # nothing unreachable
        pins: dict[bytes, int] = {}
        for session_keys in cache._pins.values():
            for key in session_keys:
                pins[key] = pins.get(key, 0) + 1
        assert all(b.pins == pins.get(k, 0) for k, b in blocks.items())
        assert cache.pinned_bytes() == sum(b.nbytes for b in blocks.values() if b.pins)
