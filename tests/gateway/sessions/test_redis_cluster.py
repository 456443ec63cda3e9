"""Two gateways on one real 3-master Redis Cluster: the conversation state spreads over the
masters, a session moves between gateways, HTTP sessions, shared rate limits and /readyz."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest
import websockets
from openai import OpenAI

from encoder_worker.storage import NAMESPACE
from gateway.server.app import create_app
from gateway.server.runner import ServerThread
from gateway.settings import Settings
from gateway.testing.realtime_peer import Peer, data_url, image_question
from tests.gateway.caching.test_session_cache import QUESTION_1, QUESTION_2, fresh_image
from tests.gateway.conftest import gateway_settings, gateway_state

pytestmark = pytest.mark.slow

# the limit applies to every key; the conversations, the HTTP session and the rate-limit test
# each use a key of their own, so only the last one ever reaches it
KEY_WS = "cluster-key-realtime"
KEY_HTTP = "cluster-key-http"
KEY_LIMIT = "cluster-key-limited"
PER_MINUTE = 3
KV_PREFIX = "visiongate:kv:"  # RedisKVStore's default namespace


@pytest.fixture(scope="module")
def gateways(redis_cluster_server: str) -> Iterator[tuple[ServerThread, ServerThread]]:
    """Gateways A and B: separate apps, engines and memory caches, one Redis Cluster between
    them. The cluster itself is flushed after every test (the `raw_cluster` fixture)."""

    def settings() -> Settings:
        return gateway_settings(
            redis_url=redis_cluster_server,
            api_keys=[KEY_WS, KEY_HTTP, KEY_LIMIT],
            rate_limit_per_minute=PER_MINUTE,
            max_output_tokens=12,
        )

    a_settings, b_settings = settings(), settings()
    # one after the other: two model loads at once in one process race on transformers' lazy
    # imports
    with ServerThread(create_app(a_settings), a_settings) as a:
        a.wait_ready()
        with ServerThread(create_app(b_settings), b_settings) as b:
            b.wait_ready()
            yield a, b


async def open_peer(url: str, key: str, session_id: str | None = None) -> Peer:
    ws = await websockets.connect(
        url + (f"?session_id={session_id}" if session_id else ""),
        additional_headers={"Authorization": f"Bearer {key}"},
        max_size=None,
    )
    return Peer(ws, json.loads(await ws.recv()))


def stored_keys(cluster) -> list[str]:
    """Every key on every master (the cluster client's SCAN walks them all)."""
    return [k.decode() for k in cluster.scan_iter(count=1000)]


def wait_for_keys(
    cluster, wanted: dict[str, Callable[[str], bool]], timeout_s: float = 15.0
) -> dict[str, list[str]]:
    """The stored keys of each kind in `wanted`, once every kind has at least one; KV is written
    behind by a background thread, so it may land a moment after the response."""
    deadline = time.monotonic() + timeout_s
    while True:
        keys = stored_keys(cluster)
        found = {kind: [k for k in keys if match(k)] for kind, match in wanted.items()}
        if all(found.values()):
            return found
        missing = [kind for kind, ks in found.items() if not ks]
        assert time.monotonic() < deadline, f"never stored: {missing}; keys: {sorted(keys)}"
        time.sleep(0.1)


def conversation_kinds(session_id: str, digest: str) -> dict[str, Callable[[str], bool]]:
    return {
        "session": lambda k: k.startswith(f"{NAMESPACE}:session") and session_id in k,
        "vision": lambda k: k.startswith(f"{NAMESPACE}:vision:") and k.endswith(digest),
        "image": lambda k: k.startswith(f"{NAMESPACE}:image:") and k.endswith(digest),
        "kv": lambda k: k.startswith(KV_PREFIX),
    }


def sessions_gauge(server: ServerThread, until: Callable[[float], bool]) -> float:
    """The gateway's `visiongate_sessions_active` gauge once `until` holds for it (it is
    refreshed from the session store every few seconds), or its last value after 15 s."""
    deadline = time.monotonic() + 15.0
    while True:
        text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
        rows = [r for r in text.splitlines() if r.startswith("visiongate_sessions_active")]
        value = float(rows[0].split()[-1]) if rows else -1.0
        if until(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.25)


async def image_turn(peer: Peer, image: bytes, max_output_tokens: int = 8) -> dict:
    _, response = await peer.ask(
        image_question(image, QUESTION_1, "image/png"), max_output_tokens=max_output_tokens
    )
    return response


def answer_text(response: dict) -> str:
    return response["output"][0]["content"][0]["text"]


async def test_conversation_state_is_spread_over_the_masters(gateways, raw_cluster) -> None:
    a, _ = gateways
    image = fresh_image(201)
    digest = hashlib.sha256(image).hexdigest()
    peer = await open_peer(a.ws_url, KEY_WS)
    session_id = peer.session_id
    r1 = await image_turn(peer, image)
    await peer.add([{"type": "input_text", "text": QUESTION_2}])
    done2, _ = await peer.respond(max_output_tokens=8)
    r2 = done2["response"]
    await peer.close()
    assert r1["status"] in ("completed", "incomplete") and answer_text(r1)
    assert r2["status"] in ("completed", "incomplete") and answer_text(r2)
    assert r1["visiongate"]["cache"]["vision"] == "miss"
    assert r2["visiongate"]["cache"]["vision"] == "hit"

    found = wait_for_keys(raw_cluster, conversation_kinds(session_id, digest))
    keys = [k for ks in found.values() for k in ks]
    masters = {raw_cluster.get_node_from_key(k).name for k in keys}
    assert len(masters) >= 2, f"all of {keys} on {masters}"
    # what is stored is what the turns made: the image bytes as sent
    image_key = found["image"][0]
    assert raw_cluster.get(image_key) == image
    # the session count (every master's share of the expiry index) reaches the metrics
    assert sessions_gauge(a, until=lambda n: n >= 1) >= 1


async def test_second_gateway_resumes_the_session(gateways, raw_cluster) -> None:
    a, b = gateways
    image = fresh_image(202)
    digest = hashlib.sha256(image).hexdigest()
    peer = await open_peer(a.ws_url, KEY_WS)
    session_id = peer.session_id
    r1 = await image_turn(peer, image, max_output_tokens=12)
    await peer.close()
    # A keeps running; B can only find what A wrote to the cluster, KV included (written behind)
    wait_for_keys(raw_cluster, conversation_kinds(session_id, digest))

    b_encodes = gateway_state(b).require().vision.encodes
    peer = await open_peer(b.ws_url, KEY_WS, session_id)
    history = peer.created["session"]["visiongate"]["items"]
    assert [i["role"] for i in history] == ["user", "assistant"]
    assert history[1]["content"][0]["text"] == answer_text(r1)
    await peer.add([{"type": "input_text", "text": QUESTION_2}])
    done2, _ = await peer.respond(max_output_tokens=8)
    await peer.close()
    r2 = done2["response"]
    assert r2["visiongate"]["cache"]["vision"] == "hit"
    assert r2["visiongate"]["timings"]["encode_ms"] == 0.0
    assert gateway_state(b).require().vision.encodes == b_encodes
    # turn 1's KV came from the cluster: B prefilled only the new words
    turn1 = r1["usage"]
    cached = r2["usage"]["input_token_details"]["cached_tokens"]
    assert turn1["input_tokens"] + turn1["output_tokens"] - 1 <= cached
    assert cached < r2["usage"]["input_tokens"]


def test_http_session_continues_on_the_other_gateway(gateways, raw_cluster) -> None:
    a, b = gateways
    image = fresh_image(203)
    session_id = f"cluster-http-{uuid.uuid4().hex[:8]}"
    with (
        OpenAI(base_url=f"{a.http_url}/v1", api_key=KEY_HTTP, max_retries=0, timeout=300) as on_a,
        OpenAI(base_url=f"{b.http_url}/v1", api_key=KEY_HTTP, max_retries=0, timeout=300) as on_b,
    ):
        model = on_a.models.list().data[0].id
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(image, "image/png")}},
                    {"type": "text", "text": QUESTION_1},
                ],
            }
        ]
        first = on_a.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=8, extra_body={"session_id": session_id}
        )
        assert first.status_code == 200
        first = first.parse()
        assert first.usage.model_extra["visiongate"]["session_id"] == session_id
        answer = first.choices[0].message.content
        assert answer

        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": QUESTION_2},
        ]
        second = on_b.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=8, extra_body={"session_id": session_id}
        )
        assert second.status_code == 200
        second = second.parse()
        ext = second.usage.model_extra["visiongate"]
        assert ext["session_id"] == session_id
        assert ext["cache"]["vision"] == "hit" and ext["timings"]["encode_ms"] == 0.0
        assert second.usage.prompt_tokens > first.usage.prompt_tokens

        # the session B answered from holds A's turn once, then its own
        stored = on_b.get(f"/sessions/{session_id}", cast_to=object)
        assert [i["role"] for i in stored["items"]] == ["user", "assistant", "user", "assistant"]
        assert stored["items"][1]["content"][0]["text"] == answer
    assert any(session_id in k for k in stored_keys(raw_cluster))


def test_rate_limit_holds_across_gateways(gateways, raw_cluster) -> None:
    a, b = gateways
    # the cluster counts in fixed one-minute windows: all 8 requests must fall in one
    if 60 - time.time() % 60 < 10:
        time.sleep(60 - time.time() % 60 + 0.5)
    window = int(time.time() // 60)
    headers = {"Authorization": f"Bearer {KEY_LIMIT}"}
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 1,
    }
    statuses, codes = [], []
    with httpx.Client(timeout=120) as http:
        for n in range(8):
            server = (a, b)[n % 2]
            r = http.post(f"{server.http_url}/v1/chat/completions", json=body, headers=headers)
            statuses.append(r.status_code)
            codes.append(r.json()["error"]["code"] if r.status_code != 200 else None)
    assert int(time.time() // 60) == window, "the requests straddled a minute boundary"
    assert statuses == [200] * PER_MINUTE + [429] * (8 - PER_MINUTE), codes
    assert codes[PER_MINUTE:] == ["rate_limited"] * (8 - PER_MINUTE)
    # one shared counter on the cluster saw every request, from both gateways
    counters = [k for k in stored_keys(raw_cluster) if k.startswith(f"{NAMESPACE}:rate:")]
    assert len(counters) == 1 and int(raw_cluster.get(counters[0])) == 8


def test_readyz_is_ready_on_the_cluster(gateways) -> None:
    for server in gateways:
        r = httpx.get(f"{server.http_url}/readyz", timeout=10)
        assert r.status_code == 200, r.text
        assert r.json() == {"status": "ready", "model": "SmolLM2-135M-Instruct"}
