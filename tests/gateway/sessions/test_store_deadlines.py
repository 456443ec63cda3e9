"""A slow or stalled Redis under the session store and the response records: every call ends
within its deadline, one request's calls within one bound, and an answer the store did not take
is never reported as given, on any API.

A private redis-server (with `DEBUG SLEEP` allowed) is stalled for real; the gateways are the
real app over the fake engine, whose deltas are spaced so that a stall lands mid-answer.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from gateway.caching.redis_deadline import open_request_budget, request_budget
from gateway.protocol.errors import GatewayError
from gateway.sessions.redis import RedisSessionStore
from gateway.sessions.response_records import RedisResponseStore
from gateway.sessions.session import Session
from gateway.settings import Settings, SettingsError
from gateway.testing.fakes import FakeEngine
from gateway.testing.ports import free_port, wait_for_port
from gateway.testing.realtime_peer import Peer
from tests.conftest import sleep_redis, start_redis

OWNER = "anonymous"
BOUND_S = 0.6  # the gateways' store_timeout_s here
WORD_S = 0.25  # the fake engine's time per text delta: a 6-word answer takes ~2 s


class StallableRedis:
    """A redis-server of this module's own that a test may stall (`DEBUG SLEEP`)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.workdir = tempfile.mkdtemp(prefix="visiongate-stall-")
        self.proc = start_redis(self.port, self.workdir, "--enable-debug-command", "yes")
        wait_for_port(self.port)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def stall(self, seconds: float, after_s: float = 0.0) -> threading.Thread:
        """Make the server sleep `seconds` (after `after_s`), from a thread."""
        return sleep_redis(self.port, seconds, after_s)

    def flush(self) -> None:
        import redis

        client = redis.Redis(port=self.port)
        client.flushall()
        client.close()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def stallable() -> Iterator[StallableRedis]:
    server = StallableRedis()
    yield server
    server.close()


@pytest.fixture
def stall_redis(stallable: StallableRedis) -> Iterator[StallableRedis]:
    yield stallable
    stallable.flush()


def wait_out(thread: threading.Thread) -> None:
    thread.join(timeout=30)
    assert not thread.is_alive()


# ---------------------------------------------------------------- the stores' deadlines


async def test_a_store_call_on_a_stalled_redis_ends_within_its_deadline(stall_redis) -> None:
    store = RedisSessionStore(stall_redis.url, 60, timeout_s=0.5)
    session = Session.new(OWNER, instructions="", max_output_tokens=8)
    assert await store.create(session)
    stall = stall_redis.stall(2.0)
    await asyncio.sleep(0.2)
    t0 = time.perf_counter()
    with pytest.raises(GatewayError) as refused:
        await store.load(session.id, OWNER)
    took = time.perf_counter() - t0
    assert refused.value.code == "busy" and refused.value.http_status == 503
    assert 0.4 <= took < 1.0, took  # its deadline, not the stall (nor 3 socket timeouts)
    wait_out(stall)
    assert (await store.load(session.id, OWNER)).id == session.id  # and back when Redis is
    await store.aclose()


async def test_one_requests_store_calls_share_one_bound(stall_redis) -> None:
    sessions = RedisSessionStore(stall_redis.url, 60, timeout_s=5.0)
    records = RedisResponseStore(stall_redis.url, 60, timeout_s=5.0)
    session = Session.new(OWNER, instructions="", max_output_tokens=8)
    assert await sessions.create(session)
    stall = stall_redis.stall(3.0)
    await asyncio.sleep(0.2)

    async def request() -> list[float]:  # a task of its own, as every request is
        open_request_budget(0.8)
        took = []
        for call in (
            lambda: sessions.load(session.id, OWNER),
            lambda: sessions.update(session.id, OWNER, lambda s: None),
            lambda: records.get("resp_x", OWNER),
        ):
            t0 = time.perf_counter()
            with pytest.raises(GatewayError) as refused:
                await call()
            assert refused.value.code == "busy"
            took.append(time.perf_counter() - t0)
        budget = request_budget()
        assert budget is not None and budget.left_s <= 0
        return took

    took = await asyncio.create_task(request())
    assert request_budget() is None  # the request's bound stayed with its task
    # the first call waited the whole bound, the others found it spent and did not wait
    assert 0.7 <= took[0] < 1.2 and took[1] < 0.05 and took[2] < 0.05, took
    wait_out(stall)
    await sessions.aclose()
    await records.aclose()


@pytest.mark.parametrize("value", [0, -1, 0.01, 121, float("nan")])
def test_a_store_timeout_that_cannot_work_is_refused_at_start(value: float) -> None:
    with pytest.raises(SettingsError, match="STORE_TIMEOUT_S"):
        Settings.load({"store_timeout_s": value}, environ={})
    assert Settings.load({"store_timeout_s": 0.5}, environ={}).store_timeout_s == 0.5


# ---------------------------------------------------------------- nothing unstored acknowledged


@pytest.fixture
def slow_gateway(make_gateway, stall_redis):
    """A gateway on the stallable Redis whose fake engine takes ~2 s for a 6-word answer."""
    return make_gateway(
        engine=FakeEngine(delay_s=WORD_S),
        settings=dict(redis_url=stall_redis.url, store_timeout_s=BOUND_S),
    )


QUESTION = "one two three four five six"  # echoed back: 7 deltas with "[0 images]"


def stalled_mid_answer(stall_redis: StallableRedis) -> threading.Thread:
    """Redis stalls from 1 s into the answer until past its end (~2 s)."""
    return stall_redis.stall(2.5, after_s=1.0)


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def test_a_responses_answer_not_stored_is_503_busy_with_no_id(slow_gateway, stall_redis) -> None:
    with httpx.Client(base_url=slow_gateway.http_url, timeout=20) as http:
        first = http.post("/v1/responses", json={"model": "fake-echo", "input": "hello"})
        assert first.status_code == 200 and first.json()["status"] == "completed"
        stall = stalled_mid_answer(stall_redis)
        body = {"model": "fake-echo", "input": QUESTION, "previous_response_id": first.json()["id"]}
        answer, took = timed(lambda: http.post("/v1/responses", json=body))
        wait_out(stall)
        assert isinstance(answer, httpx.Response)
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "busy" and "id" not in answer.json()
        assert took < 2.0 + BOUND_S + 1.0, took  # the answer's time and the bound, no more
        # the client retries the turn: the chain goes on from the last response it was given
        again = http.post("/v1/responses", json=body)
        assert again.status_code == 200 and again.json()["status"] == "completed"
        record = http.get(f"/v1/responses/{again.json()['id']}")
        assert record.status_code == 200
        follow = {**body, "input": "seven", "previous_response_id": again.json()["id"]}
        assert http.post("/v1/responses", json=follow).status_code == 200


def test_a_streamed_response_not_stored_ends_failed(slow_gateway, stall_redis) -> None:
    client = slow_gateway.openai_client(timeout=20)
    stall = stalled_mid_answer(stall_redis)
    events = list(client.responses.create(model="fake-echo", input=QUESTION, stream=True))
    wait_out(stall)
    types = [e.type for e in events]
    assert "response.output_text.delta" in types  # its text went out before the end
    assert types[-1] == "response.failed" and "response.completed" not in types
    failed = events[-1].response
    assert failed.status == "failed" and failed.error is not None
    assert (failed.error.code, failed.error.type) == ("server_error", "busy")
    assert failed.model_extra["visiongate"]["stored"] is False
    client.close()


def test_a_chat_answer_not_stored_is_an_error_not_a_finish(slow_gateway, stall_redis) -> None:
    client = slow_gateway.openai_client(timeout=20)
    session = {"session_id": "chat-stall"}
    messages = [{"role": "user", "content": QUESTION}]
    # streamed: the text came, then an error event instead of the finish chunk
    stall = stalled_mid_answer(stall_redis)
    finishes = []
    with pytest.raises(openai.APIError) as failed:
        for chunk in client.chat.completions.create(
            model="fake-echo", messages=messages, stream=True, extra_body=session
        ):
            finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
    wait_out(stall)
    assert failed.value.code == "busy" and finishes == []
    # not streamed: 503 busy, which the SDK's own retries take (Retry-After: 1)
    stall = stalled_mid_answer(stall_redis)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="fake-echo", messages=messages, extra_body=session)
    wait_out(stall)
    assert refused.value.status_code == 503 and refused.value.code == "busy"
    answer = client.chat.completions.create(
        model="fake-echo", messages=messages, extra_body=session
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    client.close()


async def test_a_realtime_answer_not_stored_is_done_as_failed(slow_gateway, stall_redis) -> None:
    peer = await Peer.open(slow_gateway.ws_url)
    await peer.add([{"type": "input_text", "text": QUESTION}])
    await peer.until("conversation.item.done")
    stall = stalled_mid_answer(stall_redis)
    done, seen = await peer.respond()
    await asyncio.to_thread(wait_out, stall)
    assert done["response"]["status"] == "failed"
    assert done["response"]["status_details"]["error"]["code"] == "busy"
    assert any(e["type"] == "error" and e["error"]["code"] == "busy" for e in seen)
    assert not any(e["type"] == "response.output_item.done" for e in seen)
    # the conversation goes on, and the failed answer's place is not read into it
    await peer.add([{"type": "input_text", "text": "seven"}])
    await peer.until("conversation.item.done")
    done, _ = await peer.respond()
    assert done["response"]["status"] == "completed"
    await peer.close()
    again = await Peer.open(slow_gateway.ws_url, peer.session_id)
    items = again.created["session"]["visiongate"]["items"]
    assert all(i.get("status") != "in_progress" for i in items), items
    await again.close()


def test_every_store_call_of_a_streamed_answer_is_under_its_requests_bound(
    make_gateway, monkeypatch
) -> None:
    """The stream's body is sent after its handler returned: its writes (the answer's place
    filled) must still count against the request's bound, not run unbounded."""
    from gateway.sessions.memory import MemorySessionStore

    seen: list[object] = []
    update = MemorySessionStore.update

    async def recording(self, session_id, owner, mutate):
        seen.append(request_budget())
        return await update(self, session_id, owner, mutate)

    monkeypatch.setattr(MemorySessionStore, "update", recording)
    gateway = make_gateway(settings=dict(store_timeout_s=0.75))
    client = gateway.openai_client()
    messages = [{"role": "user", "content": "hello there"}]
    chunks = client.chat.completions.create(
        model="fake-echo", messages=messages, stream=True, extra_body={"session_id": "bound"}
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    events = list(client.responses.create(model="fake-echo", input="hello", stream=True))
    assert events[-1].type == "response.completed"
    client.close()
    # chat: the session brought in line, the place taken, filled; responses: taken, filled
    assert len(seen) >= 5
    assert all(getattr(b, "total_s", None) == 0.75 for b in seen), seen
