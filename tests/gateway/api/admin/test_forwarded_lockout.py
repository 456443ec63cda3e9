"""The admin lockout counts the client address (gateway/server/client_address.py): the TCP peer
unless it is a trusted proxy. A forged `X-Forwarded-For` from any other peer moves nothing; a
trusted proxy's header names the client. Guesses shaped like ephemeral keys count, admin keys
shaped like managed or ephemeral ones are refused at start, and IPv4-mapped IPv6 peers count
by their IPv4 address."""

from __future__ import annotations

import httpx
import pytest

from gateway.api.admin.lockout import FREE_FAILURES, client_of
from gateway.settings import Settings, SettingsError

ADMIN = "admin-0123456789abcdef-secret"


@pytest.fixture(autouse=True)
def _long_first_delay(monkeypatch) -> None:
    """A first lockout longer than any test here, so a slow machine's requests cannot outlast
    it and let one more guess through (the in-process gateways read it at each failure)."""
    from gateway.api.admin import lockout

    monkeypatch.setattr(lockout, "FIRST_DELAY_S", 120.0)


def bearer(key: str, forwarded_for: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {key}"}
    if forwarded_for is not None:
        headers["X-Forwarded-For"] = forwarded_for
    return headers


def test_forged_forwarded_for_from_an_untrusted_peer_does_not_move_the_lockout(
    make_gateway,
) -> None:
    gw = make_gateway(settings=dict(admin_api_key=ADMIN))  # no trusted proxies: the default
    url = f"{gw.http_url}/v1/admin/keys"
    statuses = [
        httpx.get(url, headers=bearer(f"guess-{i:04d}-aaaaaaaa", f"198.51.100.{i}")).status_code
        for i in range(40)
    ]
    # the free ones, then locked out: every guess was the loopback peer's, whatever it claimed
    assert statuses == [401] * FREE_FAILURES + [429] * (40 - FREE_FAILURES), statuses
    httpx.get(url, headers=bearer("one-more-guess-aaaa", "198.51.100.200"))
    r = httpx.get(url, headers=bearer(ADMIN))  # the real peer, the right key: locked out
    assert r.status_code == 429 and r.json()["error"]["code"] == "auth_locked_out"
    # nor can a forged header get a locked-out client a fresh count
    r = httpx.get(url, headers=bearer(ADMIN, "203.0.113.99"))
    assert r.status_code == 429


def test_a_trusted_proxys_header_names_the_client(make_gateway) -> None:
    gw = make_gateway(settings=dict(admin_api_key=ADMIN, trusted_proxies=["127.0.0.1"]))
    url = f"{gw.http_url}/v1/admin/keys"
    for i in range(FREE_FAILURES):
        r = httpx.get(url, headers=bearer(f"guess-{i:04d}-aaaaaaaa", "203.0.113.7"))
        assert r.status_code == 401
    # 203.0.113.7 is locked out, the right key included
    assert httpx.get(url, headers=bearer(ADMIN, "203.0.113.7")).status_code == 429
    # another client behind the same proxy is not
    assert httpx.get(url, headers=bearer(ADMIN, "198.51.100.1")).status_code == 200
    # a client that writes the locked address itself is still counted as where it came from
    assert httpx.get(url, headers=bearer(ADMIN, "203.0.113.7, 198.51.100.2")).status_code == 200
    # and the proxy's own address (a request with no header) has a count of its own
    assert httpx.get(url, headers=bearer(ADMIN)).status_code == 200


def test_guesses_shaped_like_ephemeral_keys_are_counted(make_gateway) -> None:
    gw = make_gateway(settings=dict(admin_api_key=ADMIN))
    url = f"{gw.http_url}/v1/admin/keys"
    statuses = [
        httpx.get(url, headers=bearer(f"ek_{i:043d}")).status_code for i in range(FREE_FAILURES + 2)
    ]
    # refused as any ephemeral key is on an HTTP API, and counted
    assert statuses == [403] * FREE_FAILURES + [429, 429]


@pytest.mark.parametrize("admin", ["vgk-" + "a" * 43, "ek_" + "b" * 43, "ek_admin-key-longer"])
def test_an_admin_key_shaped_like_a_managed_or_ephemeral_key_is_refused(admin: str) -> None:
    with pytest.raises(SettingsError, match="VISIONGATE_ADMIN_API_KEY: must not start like"):
        Settings.load({"admin_api_key": admin}, environ={})


def test_ipv4_mapped_peers_count_by_their_ipv4_address() -> None:
    assert client_of("::ffff:192.0.2.1") == "192.0.2.1"
    assert client_of("::ffff:192.0.2.1") != client_of("::ffff:192.0.2.2")
    assert client_of("::ffff:c000:201") == "192.0.2.1"  # the same address, spelt in hex
    assert client_of("192.0.2.1") == "192.0.2.1"
    assert client_of("2001:db8::1") == client_of("2001:db8::ffff") == "2001:db8::/64"
    assert client_of("fe80::1%eth0") == "fe80::/64"
    assert client_of("not an address") == "not an address"
