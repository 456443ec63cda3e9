"""Managed API keys over real gateways (the fake engine/encoder) and a real redis-server:
create, use, revoke across two replicas on one Redis (the other replica refuses within seconds,
an open WebSocket is closed with the error), expiry, the official `openai` client with a created
key, and an attacker's pass over the admin API."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import websockets

ADMIN = "admin-0123456789abcdef-secret"
STATIC = "sk-static-5b8e0f2d9c41a7"


def admin_headers(key: str = ADMIN) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def replicas(make_gateway, redis_url):
    settings = dict(admin_api_key=ADMIN, api_keys=[STATIC], redis_url=redis_url)
    return make_gateway(settings=settings), make_gateway(settings=settings)


def create(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/admin/keys", json={"name": "t", **body}, headers=admin_headers())
    assert r.status_code == 201, r.text
    assert r.headers["cache-control"] == "no-store"
    return r.json()


def models(url: str, key: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})


async def test_create_use_revoke_across_replicas(replicas) -> None:
    a, b = replicas
    made = create(a.http_url, owner="acme", rpm=1000)
    secret, key_id = made["secret"], made["id"]
    assert secret.startswith("vgk-") and key_id.startswith("key_")
    assert made["redacted_key"] == f"vgk-...{secret[-4:]}"
    assert models(a.http_url, secret).status_code == 200
    assert models(b.http_url, secret).status_code == 200  # the other replica, same Redis
    assert models(b.http_url, STATIC).status_code == 200  # static keys still work
    listed = httpx.get(f"{b.http_url}/v1/admin/keys", headers=admin_headers()).json()
    assert [k["id"] for k in listed["data"]] == [key_id] and "secret" not in listed["data"][0]
    # the stored record holds no secret
    got = httpx.get(f"{b.http_url}/v1/admin/keys/{key_id}", headers=admin_headers())
    assert got.status_code == 200 and secret not in got.text

    async with websockets.connect(
        b.ws_url, additional_headers={"Authorization": f"Bearer {secret}"}
    ) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        revoked = httpx.delete(f"{a.http_url}/v1/admin/keys/{key_id}", headers=admin_headers())
        assert revoked.status_code == 200 and revoked.json()["revoked"] is True
        t0 = time.monotonic()
        assert models(a.http_url, secret).json()["error"]["code"] == "api_key_revoked"
        # the other replica: within a couple of seconds (its cache lives 1 s)
        while models(b.http_url, secret).status_code == 200:
            assert time.monotonic() - t0 < 5
            await asyncio.sleep(0.1)
        assert models(b.http_url, secret).json()["error"]["code"] == "api_key_revoked"
        # the open WebSocket gets the error, then a 1008 close
        async with asyncio.timeout(8):
            error = json.loads(await ws.recv())
            assert error["type"] == "error" and error["error"]["code"] == "api_key_revoked"
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
        assert closed.value.rcvd.code == 1008
        assert time.monotonic() - t0 < 5
    with pytest.raises(websockets.InvalidStatus):
        await websockets.connect(b.ws_url, additional_headers={"Authorization": f"Bearer {secret}"})


async def test_expired_key_is_refused(replicas) -> None:
    a, _ = replicas
    made = create(a.http_url, expires_in_s=1.5)
    assert models(a.http_url, made["secret"]).status_code == 200
    await asyncio.sleep(2.6)
    r = models(a.http_url, made["secret"])
    assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_expired"
    past = httpx.post(
        f"{a.http_url}/v1/admin/keys",
        json={"name": "x", "expires_at": time.time() - 10},
        headers=admin_headers(),
    )
    assert past.status_code == 400 and past.json()["error"]["code"] == "invalid_request"


async def test_model_allow_list_and_per_key_rpm(replicas) -> None:
    a, _ = replicas
    other = create(a.http_url, models=["some-other-model"])
    r = models(a.http_url, other["secret"])
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    slow = create(a.http_url, rpm=2)
    client = openai.OpenAI(base_url=f"{a.http_url}/v1", api_key=slow["secret"], max_retries=0)
    model = client.models.list().data[0].id
    for _ in range(2):
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert out.choices[0].message.content
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    # the two responses it started are its usage
    admin = admin_headers()
    for _ in range(50):
        usage = httpx.get(f"{a.http_url}/v1/admin/usage", headers=admin).json()["data"]
        counts = {u["id"]: u["requests"] for u in usage}
        if counts.get(slow["id"]) == 2:
            break
        await asyncio.sleep(0.05)
    assert counts[slow["id"]] == 2 and counts[other["id"]] == 0


def test_attackers_pass_over_the_admin_api(replicas) -> None:
    a, _ = replicas
    url = f"{a.http_url}/v1/admin/keys"
    made = create(a.http_url)
    # no key, a wrong key, the admin key in the query: 401
    for headers, params in (
        ({}, {}),
        (admin_headers("not-the-admin-key"), {}),
        ({}, {"key": ADMIN}),
    ):
        r = httpx.get(url, headers=headers, params=params)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    # a normal key, static or managed: 403, on every route
    for key in (STATIC, made["secret"]):
        for method, path in (
            ("GET", ""),
            ("POST", ""),
            ("GET", f"/{made['id']}"),
            ("DELETE", f"/{made['id']}"),
        ):
            r = httpx.request(method, url + path, headers=admin_headers(key), json={"name": "x"})
            assert r.status_code == 403, (method, path, r.text)
            assert r.json()["error"]["code"] == "permission_denied"
    assert models(a.http_url, made["secret"]).status_code == 200  # nothing was revoked
    # forged and unknown ids: 404, never a 500
    for forged in ("key_000000000000000000000000", "key_../../etc", "x" * 5000, "%00", "key_"):
        for method in ("GET", "DELETE"):
            r = httpx.request(method, f"{url}/{forged}", headers=admin_headers())
            assert r.status_code == 404, (forged, r.text)
    # huge or malformed pages: 400; the largest page is bounded
    for params in (
        {"limit": "1000000"},
        {"limit": "9" * 5000},
        {"limit": "-1"},
        {"limit": "x"},
        {"after": "nope"},
    ):
        r = httpx.get(url, headers=admin_headers(), params=params)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    assert httpx.get(url, headers=admin_headers(), params={"limit": "200"}).status_code == 200
    # bad and oversized bodies: stable codes, nothing stored
    before = len(httpx.get(url, headers=admin_headers()).json()["data"])
    for body, code in (
        (b"{", "invalid_json"),
        (b"[]", "invalid_request"),
        (b'{"name": ""}', "invalid_request"),
        (b'{"name": "x", "rpm": -5}', "invalid_request"),
        (b'{"name": "x", "admin": true}', "invalid_request"),
        (b'{"name": "x", "models": []}', "invalid_request"),
        (b'{"name": "x", "budget_tokens": 5}', "invalid_request"),
        (json.dumps({"name": "x" * 300}).encode(), "invalid_request"),
        (json.dumps({"name": "x", "models": ["m"] * 100_000}).encode(), "request_too_large"),
    ):
        r = httpx.post(
            url, content=body, headers={**admin_headers(), "content-type": "application/json"}
        )
        assert r.json()["error"]["code"] == code, (body[:40], r.text)
        assert r.status_code in (400, 413)
    assert len(httpx.get(url, headers=admin_headers()).json()["data"]) == before
    # the admin key is not an API key
    assert models(a.http_url, ADMIN).status_code == 401


def test_paging_and_usage(replicas) -> None:
    a, _ = replicas
    ids = [create(a.http_url, name=f"k{i}")["id"] for i in range(5)]
    url = f"{a.http_url}/v1/admin/keys"
    seen, after = [], None
    while True:
        params = {"limit": "2", **({"after": after} if after else {})}
        page = httpx.get(url, headers=admin_headers(), params=params).json()
        seen += [k["id"] for k in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == sorted(ids)
    usage = httpx.get(f"{a.http_url}/v1/admin/usage", headers=admin_headers()).json()
    assert [u["id"] for u in usage["data"]] == sorted(ids)


def test_no_admin_api_without_the_setting(fake_gateway) -> None:
    r = httpx.get(f"{fake_gateway.http_url}/v1/admin/keys", headers=admin_headers())
    assert r.status_code == 404
