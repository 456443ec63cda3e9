"""Ephemeral Realtime keys over real gateways (fake engine/encoder), loopback HTTP and WebSocket:
minted by the official `openai` client with a static or managed key, used on another replica
(same Redis) and on a Redis Cluster, refused on every HTTP API and after expiry, bound to the
parent's owner, rate limit and revocation, with nothing secret at rest."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import websockets

from gateway.testing.realtime_peer import Peer

ADMIN = "admin-0123456789abcdef-secret"
STATIC = "sk-static-5b8e0f2d9c41a7"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def mint(url: str, key: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/realtime/client_secrets", json=body or {}, headers=bearer(key))


def create_key(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/admin/keys", json={"name": "t", **body}, headers=bearer(ADMIN))
    assert r.status_code == 201, r.text
    return r.json()


async def refused(url: str, key: str, *, at_handshake: bool = True) -> tuple[dict, int, str]:
    """Open with `key` as a browser would, expecting the error event and the 1008 close: at
    once (`at_handshake`), or after a session.created when the key's parent was revoked a
    moment ago (the replica's cached record of it is at most a second old; an open connection
    re-checks its parent every second)."""
    ws = await websockets.connect(url, subprotocols=["realtime", f"openai-insecure-api-key.{key}"])  # type: ignore[list-item]
    event = json.loads(await asyncio.wait_for(ws.recv(), 10))
    if not at_handshake and event["type"] == "session.created":
        event = json.loads(await asyncio.wait_for(ws.recv(), 10))
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None
    return event, closed.value.rcvd.code, closed.value.rcvd.reason


@pytest.fixture
def replicas(make_gateway, redis_url):
    settings = dict(admin_api_key=ADMIN, api_keys=[STATIC], redis_url=redis_url)
    return make_gateway(settings=settings), make_gateway(settings=settings)


async def test_minted_with_the_sdk_used_on_another_replica_with_its_settings(
    replicas, raw_redis
) -> None:
    a, b = replicas
    client = openai.OpenAI(base_url=f"{a.http_url}/v1", api_key=STATIC, max_retries=0)
    t0 = time.time()
    made = client.realtime.client_secrets.create(
        expires_after={"anchor": "created_at", "seconds": 120},
        session={"type": "realtime", "instructions": "Answer briefly.", "max_output_tokens": 7},
    )
    secret = made.value
    assert secret.startswith("ek_") and len(secret) > 40
    assert t0 + 119 <= made.expires_at <= time.time() + 121
    assert made.session.instructions == "Answer briefly."
    # at rest: only its digest, in one key of its own with a TTL past its expiry
    keys = [k.decode() for k in raw_redis.keys("vg:client-secret:*")]
    assert len(keys) == 1 and secret not in keys[0]
    assert secret.encode() not in raw_redis.get(keys[0])
    assert 120 < raw_redis.ttl(keys[0]) <= 120 + 300

    async with Peer.connected(b.ws_url, api_key=secret) as peer:  # the other replica
        updated = await peer.recv(10)
        assert updated["type"] == "session.updated"
        assert updated["session"]["instructions"] == "Answer briefly."
        assert updated["session"]["max_output_tokens"] == 7
        text, done = await peer.ask([{"type": "input_text", "text": "hello"}])
        assert done["status"] == "completed" and text
        session_id = peer.session_id
    # the session is the parent key's: it reads it over HTTP, another key does not
    assert httpx.get(f"{a.http_url}/v1/sessions/{session_id}", headers=bearer(STATIC)).is_success
    other = create_key(a.http_url)["secret"]
    r = httpx.get(f"{a.http_url}/v1/sessions/{session_id}", headers=bearer(other))
    assert r.status_code == 404
    # the header form works too (a server-side client holding an ephemeral key)
    async with Peer.connected(a.ws_url, api_key=secret, key_in="header"):
        pass


async def test_refused_on_http_apis_and_cannot_mint(replicas) -> None:
    a, _ = replicas
    secret = mint(a.http_url, STATIC).json()["value"]
    forged = "ek_" + "A" * 43
    for key in (secret, forged):
        for method, path, body in (
            ("GET", "/v1/models", None),
            ("POST", "/v1/chat/completions", {"model": "x", "messages": []}),
            ("POST", "/v1/responses", {"model": "x", "input": "hi"}),
            ("POST", "/v1/realtime/client_secrets", {}),  # no key from a key of the browser's
            ("GET", "/v1/admin/keys", None),
        ):
            r = httpx.request(method, a.http_url + path, json=body, headers=bearer(key))
            assert r.status_code == 403, (path, r.text)
            assert r.json()["error"]["code"] == "permission_denied", (path, r.text)
    # a forged one on the WebSocket: the error event names the code, then 1008
    event, code, reason = await refused(a.ws_url, forged)
    assert event["type"] == "error" and event["error"]["code"] == "unauthorized"
    assert code == 1008 and reason == "unauthorized" and forged not in json.dumps(event)
    # without a key, minting is refused like any API call
    r = httpx.post(f"{a.http_url}/v1/realtime/client_secrets", json={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"


async def test_refused_after_expiry_open_connection_lives_on(replicas) -> None:
    a, b = replicas
    made = mint(a.http_url, STATIC, {"expires_after": {"anchor": "created_at", "seconds": 10}})
    assert made.status_code == 200 and made.headers["cache-control"] == "no-store"
    secret, expires_at = made.json()["value"], made.json()["expires_at"]
    async with Peer.connected(b.ws_url, api_key=secret) as peer:
        await asyncio.sleep(max(0.0, expires_at - time.time()) + 1.2)
        # past its expiry a new connection is refused, on either replica
        for url in (a.ws_url, b.ws_url):
            event, code, reason = await refused(url, secret)
            assert event["error"]["code"] == "api_key_expired" and code == 1008
            assert reason == "api_key_expired"
        # the one opened in time goes on (its parent still stands)
        text, done = await peer.ask([{"type": "input_text", "text": "still here?"}])
        assert done["status"] == "completed"


async def test_parent_revocation_ends_its_ephemeral_keys(replicas) -> None:
    a, b = replicas
    parent = create_key(a.http_url, owner="acme")
    secret = mint(a.http_url, parent["secret"]).json()["value"]
    async with Peer.connected(b.ws_url, api_key=secret) as peer:
        r = httpx.delete(f"{a.http_url}/v1/admin/keys/{parent['id']}", headers=bearer(ADMIN))
        assert r.status_code == 200
        t0 = time.monotonic()
        async with asyncio.timeout(8):
            error, _ = await peer.until("error")
            assert error["error"]["code"] == "api_key_revoked"
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await peer.recv()
        assert closed.value.rcvd.code == 1008 and time.monotonic() - t0 < 5
    event, code, _ = await refused(a.ws_url, secret, at_handshake=False)
    assert event["error"]["code"] == "api_key_revoked" and code == 1008


async def test_bound_to_the_parents_rate_limit(replicas) -> None:
    a, _ = replicas
    parent = create_key(a.http_url, rpm=2)
    secret = mint(a.http_url, parent["secret"]).json()["value"]  # the first of its 2
    async with Peer.connected(a.ws_url, api_key=secret) as peer:
        _, done = await peer.ask([{"type": "input_text", "text": "one"}])  # the second
        assert done["status"] == "completed"
        for _ in range(50):  # the first response's end reaches the connection's state after
            await peer.send({"type": "response.create"})  # its response.done
            error, _ = await peer.until("error")
            if error["error"]["code"] != "response_in_progress":
                break
            await asyncio.sleep(0.1)
        assert error["error"]["code"] == "rate_limited"
    r = mint(a.http_url, parent["secret"])
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
    assert "retry-after" in r.headers


def test_attackers_pass_over_minting(replicas) -> None:
    a, _ = replicas
    url = f"{a.http_url}/v1/realtime/client_secrets"
    headers = {**bearer(STATIC), "content-type": "application/json"}
    for body, code in (
        (b"{", "invalid_json"),
        (b"[]", "invalid_request"),
        (b'{"expires_after": {"seconds": 5}}', "invalid_request"),
        (b'{"expires_after": {"seconds": 7201}}', "invalid_request"),
        (b'{"expires_after": {"seconds": 99999999999999999999}}', "invalid_request"),
        (b'{"expires_after": {"seconds": "60"}}', "invalid_request"),
        (b'{"expires_after": {"anchor": "now", "seconds": 60}}', "invalid_request"),
        (b'{"expires_after": {"seconds": 60, "extra": 1}}', "invalid_request"),
        (b'{"admin": true}', "invalid_request"),
        (b'{"session": {"temperature": 9}}', "invalid_request"),
        (b'{"session": {"model": "another-model"}}', "model_not_found"),
        (b'{"session": {"output_modalities": ["audio"]}}', "invalid_request"),
        (b'{"session": {"max_output_tokens": 0}}', "invalid_request"),
        (json.dumps({"session": {"instructions": "x" * 70_000}}).encode(), "input_too_large"),
        (json.dumps({"session": {"instructions": "x" * 9_000_000}}).encode(), "request_too_large"),
    ):
        r = httpx.post(url, content=body, headers=headers)
        assert r.json()["error"]["code"] == code, (body[:60], r.text)
        assert 400 <= r.status_code < 500
    # an empty body is the defaults: 60 s, no settings
    r = httpx.post(url, headers=bearer(STATIC))
    assert r.status_code == 200 and r.json()["expires_at"] - time.time() <= 61
    # ids and keys of any shape on the WebSocket: refused, never a 500 or a hang
    # (a subprotocol carries token characters only: no unicode, no slashes)
    for shape in ("ek_", "ek_" + "x" * 5000, "ek_..%2F..%2Fetc"):
        r = httpx.get(f"{a.http_url}/v1/models", headers=bearer(shape))
        assert r.status_code == 403


async def test_on_a_redis_cluster(make_gateway, redis_cluster_url) -> None:
    gw = make_gateway(settings=dict(api_keys=[STATIC], redis_url=redis_cluster_url))
    secret = mint(gw.http_url, STATIC).json()["value"]
    async with Peer.connected(gw.ws_url, api_key=secret) as peer:
        text, _ = await peer.ask([{"type": "input_text", "text": "hi"}])
        assert text


async def test_keyless_gateway_and_memory_store(make_gateway) -> None:
    gw = make_gateway()  # no keys: the owner is anonymous, minting still works
    made = mint(gw.http_url, "anything").json()
    async with Peer.connected(
        gw.ws_url, api_key=made["value"]
    ) as peer:  # memory store, this process
        assert peer.created["type"] == "session.created"
    event, code, _ = await refused(gw.ws_url, "ek_" + "B" * 43)
    assert event["error"]["code"] == "unauthorized" and code == 1008


async def test_ephemeral_keys_never_reach_logs(make_gateway) -> None:
    import io

    from gateway.policy.key_store import secret_digest
    from gateway.telemetry import configure_logging

    gw = make_gateway(settings=dict(api_keys=[STATIC]))
    logs = io.StringIO()
    configure_logging("debug", json=True, stream=logs)
    try:
        secret = mint(gw.http_url, STATIC).json()["value"]
        # where no pattern expects a key: a session id (query and path), a model name
        async with Peer.connected(gw.ws_url, api_key=secret):
            pass
        ws = await websockets.connect(
            f"{gw.ws_url}?session_id={secret}",
            subprotocols=["realtime", f"openai-insecure-api-key.{secret}"],  # type: ignore[list-item]
        )
        await ws.close()
        httpx.get(f"{gw.http_url}/v1/sessions/{secret}", headers=bearer(STATIC))
        httpx.post(
            f"{gw.http_url}/v1/chat/completions",
            headers=bearer(STATIC),
            json={"model": secret, "messages": [{"role": "user", "content": "hi"}]},
        )
        httpx.get(f"{gw.http_url}/v1/models", headers=bearer(secret))  # refused: 403
    finally:
        configure_logging("warning", json=True)
    text = logs.getvalue()
    assert "client_secret_created" in text and "permission_denied" in text
    assert secret not in text and secret[3:] not in text and secret_digest(secret) not in text


async def test_playground_session_with_a_managed_key(make_gateway, redis_url) -> None:
    """The operator's playground key is a managed one: the page's keys end when it is revoked."""
    admin = make_gateway(settings=dict(admin_api_key=ADMIN, redis_url=redis_url))
    made = create_key(admin.http_url, name="playground", rpm=100)
    pg = make_gateway(
        settings=dict(admin_api_key=ADMIN, redis_url=redis_url, playground_api_key=made["secret"])
    )
    r = httpx.post(f"{pg.http_url}/playground/session")
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    secret = r.json()["value"]
    assert made["secret"] not in r.text
    async with Peer.connected(pg.ws_url, api_key=secret) as peer:
        text, _ = await peer.ask([{"type": "input_text", "text": "hi"}])
        assert text
    # a gateway without a playground key mints nothing for the page
    assert httpx.post(f"{admin.http_url}/playground/session").status_code == 204
    httpx.delete(f"{admin.http_url}/v1/admin/keys/{made['id']}", headers=bearer(ADMIN))
    t0 = time.monotonic()
    while (r := httpx.post(f"{pg.http_url}/playground/session")).status_code == 200:
        assert time.monotonic() - t0 < 5
        await asyncio.sleep(0.1)
    assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_revoked"
    event, code, _ = await refused(pg.ws_url, secret, at_handshake=False)
    assert event["error"]["code"] == "api_key_revoked" and code == 1008


async def test_the_cli_mints_one_for_a_script(make_gateway, monkeypatch, capsys) -> None:
    """`visiongate client-secret`, the parent key in VISIONGATE_API_KEY: the printed key opens
    a Realtime session with the settings given; a bad one or a refused parent exits 1."""
    from gateway.cli.main import main

    gw = make_gateway(settings=dict(api_keys=[STATIC]))
    monkeypatch.delenv("VISIONGATE_API_KEY", raising=False)
    assert main(["client-secret", "--url", gw.http_url]) == 2  # no parent key: says so
    capsys.readouterr()
    monkeypatch.setenv("VISIONGATE_API_KEY", STATIC)
    argv = ["client-secret", "--url", gw.http_url, "--expires-in-s", "60"]
    session = '{"type": "realtime", "instructions": "Be short."}'
    assert await asyncio.to_thread(main, [*argv, "--session", session, "--value-only"]) == 0
    secret = capsys.readouterr().out.strip()
    assert secret.startswith("ek_") and "\n" not in secret
    async with Peer.connected(gw.ws_url, api_key=secret) as peer:
        updated = await peer.recv(10)
        assert updated["session"]["instructions"] == "Be short."
    assert await asyncio.to_thread(main, argv) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["value"].startswith("ek_") and made["value"] != secret
    assert time.time() + 55 <= made["expires_at"] <= time.time() + 61
    assert await asyncio.to_thread(main, [*argv, "--session", "{not json"]) == 1
    assert json.loads(capsys.readouterr().err)["error"]["code"] == "invalid_request"
    # a key read from a file with a CRLF ending works; one with a control character inside is
    # refused without being echoed
    monkeypatch.setenv("VISIONGATE_API_KEY", STATIC + "\r\n")
    assert await asyncio.to_thread(main, [*argv, "--value-only"]) == 0
    assert capsys.readouterr().out.startswith("ek_")
    monkeypatch.setenv("VISIONGATE_API_KEY", STATIC[:6] + "\r" + STATIC[6:])
    assert await asyncio.to_thread(main, argv) == 1
    assert STATIC[6:] not in capsys.readouterr().err
    monkeypatch.setenv("VISIONGATE_API_KEY", "sk-not-a-key-of-this-gateway")
    assert await asyncio.to_thread(main, argv) == 1
    err = capsys.readouterr().err
    assert json.loads(err[err.rfind("\n{\n") + 1 :])["error"]["code"] == "unauthorized"
