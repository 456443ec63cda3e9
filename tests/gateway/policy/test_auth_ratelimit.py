"""API keys own sessions; responses are rate limited per key (memory and Redis limiters)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import websockets

from gateway.policy.auth import Authenticator
from gateway.policy.ratelimit import MemoryRateLimiter, RedisRateLimiter
from gateway.protocol.errors import GatewayError
from gateway.server.app import create_app
from gateway.server.runner import ServerThread
from gateway.testing.clock import ManualClock
from tests.gateway.conftest import gateway_settings


async def test_memory_limiter_refills_over_time() -> None:
    clock = ManualClock(1000.0)
    limiter = MemoryRateLimiter(3, clock=clock)
    for _ in range(3):
        await limiter.acquire("a")
    with pytest.raises(GatewayError) as err:
        await limiter.acquire("a")
    assert err.value.code == "rate_limited" and err.value.http_status == 429
    await limiter.acquire("b")  # owners have their own allowance
    clock.now += 20.0  # 3 per minute: one token back every 20 s
    await limiter.acquire("a")
    with pytest.raises(GatewayError):
        await limiter.acquire("a")


async def test_redis_limiter_is_shared_between_replicas(redis_url: str) -> None:
    one, two = RedisRateLimiter(2, redis_url), RedisRateLimiter(2, redis_url)
    await one.acquire("k")
    await two.acquire("k")
    with pytest.raises(GatewayError) as err:
        await one.acquire("k")
    assert err.value.code == "rate_limited"
    await one.aclose()
    await two.aclose()


async def test_redis_limiter_lets_traffic_through_when_redis_is_down() -> None:
    limiter = RedisRateLimiter(1, "redis://127.0.0.1:1/0")
    await limiter.acquire("k")
    await limiter.acquire("k")
    await limiter.aclose()


def test_authenticator() -> None:
    auth = Authenticator(["secret-1", "secret-2"])
    one = auth.owner({"authorization": "Bearer secret-1"})
    # browsers: the Realtime API's subprotocol form; a query string is not a place for keys
    two = auth.owner({}, ["realtime", "openai-insecure-api-key.secret-2"])
    assert one != two and "secret" not in one
    with pytest.raises(GatewayError):
        auth.owner({}, ["realtime", "api_key=secret-2"])
    # the header wins over the subprotocol: a bad header is not rescued by a good subprotocol
    with pytest.raises(GatewayError):
        auth.owner({"authorization": "Bearer nope"}, ["openai-insecure-api-key.secret-2"])
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic secret-1"}):
        with pytest.raises(GatewayError) as err:
            auth.owner(headers)
        assert err.value.code == "unauthorized"
    assert Authenticator([]).owner({}) == "anonymous"


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[ServerThread]:
    settings = gateway_settings(api_keys=["key-alice", "key-bob"], rate_limit_per_minute=2)
    with ServerThread(create_app(settings), settings) as server:
        server.wait_ready()
        yield server


async def _open(url: str, key: str, session_id: str | None = None):
    ws = await websockets.connect(
        url + (f"?session_id={session_id}" if session_id else ""),
        additional_headers={"Authorization": f"Bearer {key}"},
    )
    return ws, json.loads(await ws.recv())


@pytest.mark.slow
async def test_keys_own_their_sessions_and_are_rate_limited(keyed_server: ServerThread) -> None:
    url = keyed_server.ws_url
    with pytest.raises(
        websockets.InvalidStatus
    ) as refused:  # closed before the handshake completes
        await websockets.connect(url, additional_headers={"Authorization": "Bearer wrong"})
    assert refused.value.response.status_code == 403

    alice, created = await _open(url, "key-alice")
    session_id = created["session"]["id"]
    statuses = []
    for n in range(3):
        await alice.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": f"Hi {n}"}],
                    },
                }
            )
        )
        await alice.send(
            json.dumps(
                {
                    "type": "response.create",
                    "event_id": f"r{n}",
                    "response": {"max_output_tokens": 2},
                }
            )
        )
        while True:
            event = json.loads(await alice.recv())
            if event["type"] == "response.done":
                statuses.append("done")
                break
            if event["type"] == "error":
                statuses.append(event["error"]["code"])
                assert event["error"]["event_id"] == f"r{n}"
                break
    assert statuses == ["done", "done", "rate_limited"]
    await alice.close()

    # bob cannot see alice's session: the same answer as for an unknown id
    bob, event = await _open(url, "key-bob", session_id)
    assert event["type"] == "error" and event["error"]["code"] == "session_not_found"
    await bob.close()
    alice, event = await _open(url, "key-alice", session_id)
    assert event["type"] == "session.created" and event["session"]["id"] == session_id
    await alice.close()


@pytest.mark.slow
def test_http_takes_keys_from_the_header_only(keyed_server: ServerThread) -> None:
    import httpx

    url = f"{keyed_server.http_url}/v1/models"
    assert httpx.get(url, headers={"Authorization": "Bearer key-bob"}).status_code == 200
    # a key in a query string would be recorded in request spans and access logs
    refused = httpx.get(url, params={"api_key": "key-bob"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"


@pytest.mark.slow
async def test_browsers_send_the_key_as_a_subprotocol(keyed_server: ServerThread) -> None:
    from gateway.policy.auth import QUERY_KEY_REFUSED

    url = keyed_server.ws_url
    ws = await websockets.connect(url, subprotocols=["realtime", "openai-insecure-api-key.key-bob"])
    assert ws.subprotocol == "realtime"  # accepted with the public name: the key is not echoed
    assert "key-bob" not in str(ws.response.headers)
    assert json.loads(await ws.recv())["type"] == "session.created"
    await ws.close()
    # a key in the URL is refused, with a reason a browser can read
    ws = await websockets.connect(f"{url}?api_key=key-bob")
    with pytest.raises(websockets.ConnectionClosedError) as closed:
        await ws.recv()
    assert closed.value.rcvd.code == 1008 and closed.value.rcvd.reason == QUERY_KEY_REFUSED
