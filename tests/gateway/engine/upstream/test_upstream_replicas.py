"""`--engine openai` end to end: a front gateway in front of two real `visiongate serve`
replicas (each running the embedded model), all three real processes on loopback ports.

Which replica served a turn is read from the replicas themselves (their
`visiongate_responses_total` and their access log lines), never from the front gateway's
own account. The processes are started once for the module (gateway/testing/processes.py); the tests
that kill replicas run last, and a test that needs both replicas restarts a killed one.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.testing.processes import (
    ServeProcess,
    front,
    replica,
    responses_served,
    running,
    sample_sum,
    which_served,
)
from gateway.testing.realtime_peer import Peer, data_url, deltas
from gateway.testing.realtime_peer import image_question as _image_question
from tests.conftest import unique_photo

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("replicas")


@pytest.fixture(scope="module")
def replicas(logs: Path) -> Iterator[list[ServeProcess]]:
    """Two replicas running the embedded model, one engine thread each."""
    procs = [replica(f"replica{i}", logs) for i in (1, 2)]
    with running(*procs):
        yield procs


@pytest.fixture(scope="module")
def front_gw(replicas: list[ServeProcess], logs: Path) -> Iterator[ServeProcess]:
    """`visiongate serve --engine openai --upstream R1,R2`, started once the replicas answer."""
    proc = front("front", replicas, logs)
    with running(proc):
        yield proc


def _both_up(replicas: list[ServeProcess], front_gw: ServeProcess | None = None) -> None:
    """Bring back a replica an earlier test killed (the module orders its kills last, so this
    costs nothing in a full run), and wait until the front gateway routes to it again."""
    dead = [p for p in replicas if not p.alive]
    for proc in dead:
        proc.start()
    for proc in dead:
        proc.wait_ready()
    if dead and front_gw is not None:  # the front's health checks mark it up again
        deadline = time.monotonic() + 30.0
        while sample_sum(front_gw.metrics(), "visiongate_upstream_healthy") < len(replicas):
            assert time.monotonic() < deadline, "the front gateway never saw the replica again"
            time.sleep(0.2)


def _client(proc: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.base_url, api_key="test", max_retries=0, timeout=120)


def _new_access_row(proc: ServeProcess, seen: int, timeout_s: float = 10.0) -> dict[str, Any]:
    """The first access line `proc` logged after its first `seen` ones."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = proc.access_log()
        if len(rows) > seen:
            return rows[seen]
        if time.monotonic() > deadline:
            raise AssertionError(f"{proc.name} logged no new response; log:\n{proc.log_tail()}")
        time.sleep(0.05)


def _generations(proc: ServeProcess) -> list[dict[str, Any]]:
    """What the replica's engine logged at the end of each generation (finish reason, tokens)."""
    return proc.log_events("engine.generated")


def _generations_since(replicas: list[ServeProcess], seen: list[int]) -> list[dict[str, Any]]:
    return [g for p, n in zip(replicas, seen, strict=True) for g in _generations(p)[n:]]


# ---------------------------------------------------------------- the replica on its own


def test_replica_reuses_the_prefix_of_a_resent_stateless_history(
    replicas: list[ServeProcess],
) -> None:
    """What affinity routing relies on: a replica answering a stateless follow-up (the whole
    history again, the image as a data URL with its content id in `uuid`, as the front gateway
    sends it) reuses the KV of the turn before."""
    _both_up(replicas)
    client = _client(replicas[0])
    photo = unique_photo("astronaut")
    image = {
        "type": "image_url",
        "image_url": {"url": data_url(photo)},
        "uuid": hashlib.sha256(photo).hexdigest(),
    }
    messages: list[Any] = [
        {"role": "user", "content": [image, {"type": "text", "text": "What is in this photo?"}]}
    ]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    answer = first.choices[0].message.content
    assert answer
    assert first.usage is not None
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Give it a title."},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    # the image and the first question at least, and never the new words
    assert first.usage.prompt_tokens // 2 < cached < second.usage.prompt_tokens


# ---------------------------------------------------------------- through the front gateway


async def test_a_session_stays_on_one_replica_and_reuses_its_cache(
    replicas: list[ServeProcess], front_gw: ServeProcess
) -> None:
    _both_up(replicas, front_gw)
    for photo_name in ("chelsea", "coffee"):  # two sessions: stickiness by chance is 1 in 16
        peer = await Peer.open(front_gw.ws_url)
        served = []
        await peer.add(_image_question(unique_photo(photo_name), "What is in this photo?"))
        for turn, question in enumerate(("", "What colours stand out?", "Suggest a title.")):
            if question:
                await peer.add([{"type": "input_text", "text": question}])
            before = responses_served(replicas)
            seen = [len(p.access_log()) for p in replicas]
            done, events = await peer.respond(max_output_tokens=8, temperature=0)
            response = done["response"]
            assert response["status"] in ("completed", "incomplete"), response
            assert deltas(events)
            served.append(which_served(replicas, before))
            upstream = _new_access_row(replicas[served[-1]], seen[served[-1]])
            usage = response["usage"]
            # the usage the client sees is the replica's own
            assert usage["input_tokens"] == upstream["input_tokens"]
            assert usage["input_token_details"]["cached_tokens"] == upstream["cached_tokens"]
            if turn:
                assert usage["input_token_details"]["cached_tokens"] > 0
        assert len(set(served)) == 1, f"turns served by replicas {served}"
        await peer.close()


async def test_a_client_cancel_closes_the_upstream_stream(
    replicas: list[ServeProcess], front_gw: ServeProcess
) -> None:
    _both_up(replicas, front_gw)
    peer = await Peer.open(front_gw.ws_url)
    await peer.add([{"type": "input_text", "text": "Count from one to one hundred in words."}])
    seen = [len(_generations(p)) for p in replicas]
    await peer.send({"type": "response.create", "response": {"max_output_tokens": 200}})
    first, _ = await peer.until("response.output_text.delta")
    await peer.send({"type": "response.cancel"})
    done, events = await peer.until("response.done")
    response = done["response"]
    assert response["status"] == "cancelled"
    streamed = first["delta"] + deltas(events)
    assert streamed == response["output"][0]["content"][0]["text"]
    # the replica's engine saw its stream closed: it stopped the generation, far short of 200
    # tokens (its access log and response counter leave out an HTTP stream whose client left,
    # so its engine's own line is what tells)
    deadline = time.monotonic() + 10.0
    while not (
        new := [g for p, n in zip(replicas, seen, strict=True) for g in _generations(p)[n:]]
    ):
        assert time.monotonic() < deadline, "no replica's engine finished the generation"
        time.sleep(0.05)
    assert len(new) == 1, new
    assert new[0]["finish_reason"] == "cancelled", new[0]
    assert new[0]["output_tokens"] < 20, new[0]
    # the session and both gateways carry on
    done, _ = await peer.respond(max_output_tokens=4)
    assert done["response"]["status"] in ("completed", "incomplete")
    await peer.close()


def _refusals(proc: ServeProcess, code: str) -> int:
    return sum(1 for e in proc.log_events("client_error") if e.get("code") == code)


@pytest.mark.parametrize(
    ("text", "counted_by"),
    [
        # prose: the front gateway's own estimate (bytes / 3) already exceeds the context
        ("The quick brown fox jumps over the lazy dog. " * 1400, "front"),
        # digits are a token each: under the front's estimate, over the replica's own count
        ("0123456789" * 900, "replica"),
    ],
    ids=["estimated-by-front", "counted-by-replica"],
)
def test_a_prompt_past_the_context_is_context_length_exceeded(
    replicas: list[ServeProcess], front_gw: ServeProcess, text: str, counted_by: str
) -> None:
    _both_up(replicas, front_gw)
    before = [_refusals(p, "context_length_exceeded") for p in replicas]
    with pytest.raises(openai.BadRequestError) as caught:
        _client(front_gw).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=8
        )
    assert caught.value.status_code == 400
    assert caught.value.code == "context_length_exceeded"
    after = [_refusals(p, "context_length_exceeded") for p in replicas]
    assert sum(after) - sum(before) == (1 if counted_by == "replica" else 0)
    # a 400 is the client's: the replica is not marked down, the next request is served
    ok = _client(front_gw).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
    )
    assert ok.choices[0].message.content


def test_a_model_the_replicas_do_not_serve_is_upstream_error(
    replicas: list[ServeProcess], logs: Path
) -> None:
    """A front gateway configured with a model name its replicas refuse (404 upstream): the
    gateway's own configuration is wrong, so the client gets `upstream_error` (502), not a
    404 about a model it never named."""
    _both_up(replicas)
    misnamed = front("front-misnamed", replicas, logs, "--upstream-model", "no-such-model")
    with running(misnamed):
        served = _client(misnamed).models.list().data[0].id
        with pytest.raises(openai.APIStatusError) as caught:
            _client(misnamed).chat.completions.create(
                model=served, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
            )
    assert caught.value.status_code == 502
    assert caught.value.code == "upstream_error"


def test_api_keys_do_not_share_a_replicas_prefix_cache(
    replicas: list[ServeProcess], logs: Path
) -> None:
    """Two API keys on one front gateway, one replica's prefix cache: a key's repeated prompt
    is served from the cache, another key's identical prompt is not (the front sends each
    key's salt as `cache_salt`), so `cached_tokens` tells no key what another sent."""
    _both_up(replicas)
    keyed = front("front-keys", replicas[:1], logs)  # one replica: both keys meet its cache
    keyed.env["VISIONGATE_API_KEYS"] = "key-a-0001,key-b-0002"
    prompt = "Summarise in five words: " + " ".join(f"fact{i} is true." for i in range(60))
    messages = [{"role": "user", "content": prompt}]

    def cached(key: str) -> int:
        client = openai.OpenAI(base_url=keyed.base_url, api_key=key, max_retries=0, timeout=120)
        done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        return done.usage.prompt_tokens_details.cached_tokens

    with running(keyed):
        first, again, other = cached("key-a-0001"), cached("key-a-0001"), cached("key-b-0002")
    assert first == 0 and again > 100, (first, again)
    assert other == 0, other


# ---------------------------------------------------------------- replicas dying (last)


async def test_killing_the_sessions_replica_moves_the_next_turn_to_the_other(
    replicas: list[ServeProcess], front_gw: ServeProcess
) -> None:
    _both_up(replicas, front_gw)
    peer = await Peer.open(front_gw.ws_url)
    await peer.add(_image_question(unique_photo("rocket"), "What is in this photo?"))
    served = []
    for question in ("", "Describe it in three words."):
        if question:
            await peer.add([{"type": "input_text", "text": question}])
        before = responses_served(replicas)
        done, _ = await peer.respond(max_output_tokens=8, temperature=0)
        assert done["response"]["status"] in ("completed", "incomplete")
        served.append(which_served(replicas, before))
    assert served[0] == served[1]
    home = served[0]
    replicas[home].kill()

    await peer.add([{"type": "input_text", "text": "Suggest a title for it."}])
    before = responses_served(replicas)
    done, events = await peer.respond(max_output_tokens=8, temperature=0)
    response = done["response"]
    assert response["status"] in ("completed", "incomplete"), response
    assert deltas(events) and deltas(events) == response["output"][0]["content"][0]["text"]
    assert which_served(replicas, before) == 1 - home
    # the other replica had none of it: it got the whole conversation, the image included
    assert response["usage"]["input_token_details"]["image_tokens"] > 0
    await peer.close()


def test_all_replicas_down_is_upstream_error(
    replicas: list[ServeProcess], front_gw: ServeProcess
) -> None:
    for proc in replicas:
        proc.kill()
    with pytest.raises(openai.APIStatusError) as caught:
        _client(front_gw).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
        )
    assert caught.value.status_code == 502
    assert caught.value.code == "upstream_error"
    # the front gateway itself stays up and says so
    assert _client(front_gw).models.list().data
