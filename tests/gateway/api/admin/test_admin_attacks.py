"""An attacker's pass over the admin API, on a real gateway over loopback (fake engine/encoder):
guessing the admin key (locked out per client, with a doubling delay), ids and cursors of any
shape, oversized headers and bodies. Every answer is an OpenAI-shaped error with a stable code,
never a 500."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from gateway.api.admin.lockout import (
    FORGET_S,
    FREE_FAILURES,
    MAX_DELAY_S,
    AdminLockout,
    Lockout,
    RedisAdminLockout,
    client_of,
)
from gateway.protocol.errors import GatewayError

ADMIN = "admin-0123456789abcdef-secret"
STATIC = "sk-static-5b8e0f2d9c41a7"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def gw(make_gateway):
    return make_gateway(settings=dict(admin_api_key=ADMIN, api_keys=[STATIC]))


def code_of(r: httpx.Response) -> str:
    return r.json()["error"]["code"]


def test_guessing_the_admin_key_locks_the_client_out(gw) -> None:
    url = f"{gw.http_url}/v1/admin/keys"
    # requests without a key and with a valid API key guess nothing: they never lock out
    for _ in range(FREE_FAILURES + 5):
        assert code_of(httpx.get(url)) == "unauthorized"
        assert code_of(httpx.get(url, headers=bearer(STATIC))) == "permission_denied"
    assert httpx.get(url, headers=bearer(ADMIN)).status_code == 200
    for i in range(FREE_FAILURES):
        r = httpx.get(url, headers=bearer(f"guess-{i:04d}-aaaaaaaaaaaa"))
        assert r.status_code == 401 and code_of(r) == "unauthorized"
    # the tenth wrong key locked it out: even the right key is not compared now
    t0 = time.monotonic()
    for key in ("guess-more", ADMIN):
        r = httpx.get(url, headers=bearer(key))
        assert r.status_code == 429 and code_of(r) == "auth_locked_out", r.text
        assert r.headers["retry-after"] == "1"
    while httpx.get(url, headers=bearer(ADMIN)).status_code == 429:
        assert time.monotonic() - t0 < 3
        time.sleep(0.1)
    # the delay over, the right key passes and clears the count
    for i in range(FREE_FAILURES - 1):
        assert code_of(httpx.get(url, headers=bearer(f"again-{i}"))) == "unauthorized"
    assert httpx.get(url, headers=bearer(ADMIN)).status_code == 200
    # every route is guarded by the same count
    for i in range(FREE_FAILURES):
        httpx.delete(f"{url}/key_{i:024x}", headers=bearer(f"other-{i}"))
    r = httpx.post(url, json={"name": "x"}, headers=bearer(ADMIN))
    assert r.status_code == 429 and code_of(r) == "auth_locked_out"
    r = httpx.get(f"{gw.http_url}/v1/admin/usage", headers=bearer(ADMIN))
    assert r.status_code == 429
    # the rest of the gateway is not locked out
    assert httpx.get(f"{gw.http_url}/v1/models", headers=bearer(STATIC)).status_code == 200


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_the_delay_doubles_to_a_bound(backend, request) -> None:
    now = [1_000_000.0]
    if backend == "memory":
        lockout: Lockout = AdminLockout(clock=lambda: now[0])
    else:
        url = request.getfixturevalue("redis_url")
        lockout = RedisAdminLockout(url, namespace="lockout-unit", clock=lambda: now[0])
    try:
        delays = []
        for _ in range(FREE_FAILURES + 12):
            now[0] += MAX_DELAY_S + 1  # each guess after the last one's delay
            await lockout.attempt("10.0.0.1")
            try:
                await lockout.check("10.0.0.1")
            except GatewayError as exc:
                delays.append(round(exc.retry_after_s or 0.0, 3))
            else:
                delays.append(0.0)
        assert delays[: FREE_FAILURES - 1] == [0.0] * (FREE_FAILURES - 1)
        assert delays[FREE_FAILURES - 1 : FREE_FAILURES + 4] == [1.0, 2.0, 4.0, 8.0, 16.0]
        assert max(delays) == MAX_DELAY_S
        with pytest.raises(GatewayError):  # locked: not counted, refused
            await lockout.attempt("10.0.0.1")
        await lockout.check("10.0.0.2")  # another client is not locked out
        if isinstance(lockout, RedisAdminLockout):  # forgotten an hour after its last guess
            raw = request.getfixturevalue("raw_redis")
            assert 0 < raw.ttl(lockout.key("10.0.0.1")) <= FORGET_S
        now[0] += MAX_DELAY_S + 1
        await lockout.check("10.0.0.1")  # over
        await lockout.succeeded("10.0.0.1")  # the right key cleared the count
        await lockout.attempt("10.0.0.1")
        await lockout.check("10.0.0.1")
        # a valid API key as the admin key is no guess: counted, then taken back
        for _ in range(FREE_FAILURES * 2):
            await lockout.attempt("10.0.0.3")
            await lockout.forgive("10.0.0.3")
        await lockout.check("10.0.0.3")
    finally:
        await lockout.aclose()


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_burst_of_guesses_gets_the_free_ones_and_no_more(backend, request) -> None:
    """Sent at once, guesses were all checked before any was counted: each one is now counted
    as it is checked, so only the free ones reach the comparison."""
    if backend == "memory":
        lockout: Lockout = AdminLockout()
    else:
        lockout = RedisAdminLockout(request.getfixturevalue("redis_url"), namespace="burst")

    async def guess() -> bool:
        try:
            await lockout.attempt("10.0.0.4")
        except GatewayError:
            return False
        await asyncio.sleep(0.01)  # the comparison, a store read for a vgk- key
        return True

    try:
        compared = await asyncio.gather(*(guess() for _ in range(200)))
        assert sum(compared) == FREE_FAILURES
    finally:
        await lockout.aclose()


def test_an_ipv6_host_counts_by_its_64() -> None:
    assert (
        client_of("2001:db8:1:2:aaaa::1")
        == client_of("2001:db8:1:2:ffff::9")
        == ("2001:db8:1:2::/64")
    )
    assert client_of("2001:db8:1:3::1") != client_of("2001:db8:1:2::1")
    assert client_of("192.0.2.7") == "192.0.2.7"
    assert client_of("") == ""


async def test_the_process_table_is_bounded() -> None:
    lockout = AdminLockout()
    for i in range(20_000):
        await lockout.attempt(f"c{i}")
    assert len(lockout._clients) <= 10_000


async def test_without_redis_it_counts_in_the_process() -> None:
    """A Redis that does not answer: the guesses still count, here."""
    from gateway.testing.ports import free_port

    lockout = RedisAdminLockout(f"redis://127.0.0.1:{free_port()}/0")
    try:
        for _ in range(FREE_FAILURES):
            await lockout.attempt("10.0.0.9")
        with pytest.raises(GatewayError) as refused:
            await lockout.check("10.0.0.9")
        assert refused.value.code == "auth_locked_out"
    finally:
        await lockout.aclose()


def test_guesses_spread_over_two_replicas_share_one_count(make_gateway, redis_url) -> None:
    settings = dict(admin_api_key=ADMIN, api_keys=[STATIC], redis_url=redis_url)
    a, b = make_gateway(settings=settings), make_gateway(settings=settings)
    for i in range(FREE_FAILURES):
        gw = (a, b)[i % 2]
        r = httpx.get(f"{gw.http_url}/v1/admin/keys", headers=bearer(f"guess-{i:04d}-bbbbbbbbbb"))
        assert code_of(r) == "unauthorized"
    for gw in (a, b):  # locked out on both, the right key included
        r = httpx.get(f"{gw.http_url}/v1/admin/keys", headers=bearer(ADMIN))
        assert r.status_code == 429 and code_of(r) == "auth_locked_out", r.text


def test_forged_ids_cursors_and_headers(gw) -> None:
    url = f"{gw.http_url}/v1/admin/keys"
    admin = bearer(ADMIN)
    made = httpx.post(url, json={"name": "x"}, headers=admin).json()
    # ids of any shape: 404 api_key_not_found without a store read, never a 500
    for forged in (
        "key_" + "F" * 24,  # upper case is not an id
        "key_" + "0" * 24 + "0",
        made["id"] + "%00",
        "..%2F..%2Fetc%2Fpasswd",
        "%2e%2e",
        "k%C3%A9y_\u043a\u043b\u044e\u0447",
        "\u202ekey_" + "0" * 24,
        "x" * 8000,
    ):
        for method in ("GET", "DELETE"):  # (a trailing slash is the same path to the router)
            r = httpx.request(method, f"{url}/{forged}", headers=admin)
            assert r.status_code in (404, 405), (forged[:30], r.status_code, r.text)
            if r.status_code == 404 and r.headers.get("content-type", "").startswith(
                "application/json"
            ):
                assert code_of(r) in ("api_key_not_found", "invalid_request", "not_found")
    assert httpx.get(f"{url}/{made['id']}", headers=admin).json()["revoked"] is False
    # a cursor past the end: an empty page; one of any other shape: 400
    page = httpx.get(url, headers=admin, params={"after": "key_" + "f" * 24}).json()
    assert page["data"] == [] and page["has_more"] is False
    for params in (
        {"after": "key_" + "f" * 25},
        {"after": "\u043a" * 30},
        {"after": "x" * 5000},
        {"limit": "0"},
        {"limit": "201"},
        {"limit": "1e3"},
        {"limit": "\u0661"},  # an Arabic-Indic digit is a digit to str.isdigit
    ):
        r = httpx.get(url, headers=admin, params=params)
        assert r.status_code == 400 and code_of(r) == "invalid_request", (params, r.text)
    # an admin key of non-ASCII bytes, a huge Authorization header: refused, never a 500
    r = httpx.get(url, headers=[(b"authorization", "Bearer ключ-клю".encode())])
    assert r.status_code == 401 and code_of(r) == "unauthorized"
    r = httpx.get(url, headers=bearer("x" * 60_000))
    assert r.status_code in (400, 401, 431), r.status_code
    # an oversized create body: 413 request_too_large, nothing stored
    r = httpx.post(url, content=b"{" + b" " * 200_000 + b"}", headers=admin)
    assert r.status_code == 413 and code_of(r) == "request_too_large"
    assert len(httpx.get(url, headers=admin).json()["data"]) == 1
