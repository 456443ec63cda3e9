"""The client address: the TCP peer unless it is a trusted proxy, then the rightmost hop of its
forwarding header that is not itself a trusted proxy; the same address in the scope, the logs
and the lockout. Header edge cases from an attacker's pass: hops that are not addresses,
unbalanced quotes, ports, brackets, zones, IPv4-mapped peers, very many hops."""

from __future__ import annotations

import pytest

from gateway.server.client_address import MAX_HOPS, TrustedProxies, client_address
from gateway.settings import Settings, SettingsError

PROXIES = TrustedProxies(["127.0.0.1", "10.0.0.0/8", "2001:db8:ffff::/48"])
FORWARDED = TrustedProxies(["127.0.0.1"], "forwarded")


@pytest.mark.parametrize(
    ("peer", "values", "expected"),
    [
        # nothing believed from a peer that is not trusted
        ("192.0.2.9", ["203.0.113.7"], "192.0.2.9"),
        ("::ffff:192.0.2.9", ["203.0.113.7"], "192.0.2.9"),  # mapped: its IPv4 address
        ("fe80::1%eth0", [], "fe80::1"),
        # a trusted peer: the rightmost hop that is not trusted
        ("127.0.0.1", ["203.0.113.7"], "203.0.113.7"),
        ("127.0.0.1", ["198.51.100.1, 203.0.113.7, 10.1.2.3"], "203.0.113.7"),
        ("127.0.0.1", ["198.51.100.1", "203.0.113.7"], "203.0.113.7"),  # two lines: one list
        ("::ffff:127.0.0.1", ["203.0.113.7"], "203.0.113.7"),  # a mapped proxy is trusted too
        ("127.0.0.1", ["10.0.0.1, 10.0.0.2"], "10.0.0.1"),  # every hop trusted: the leftmost
        ("127.0.0.1", [], "127.0.0.1"),  # no header: the proxy itself
        # the forms proxies write
        ("127.0.0.1", ["203.0.113.7:4711"], "203.0.113.7"),
        ("127.0.0.1", ["[2001:db8::7]:4711"], "2001:db8::7"),
        ("127.0.0.1", ["2001:db8::7"], "2001:db8::7"),
        ("127.0.0.1", ["::ffff:203.0.113.7"], "203.0.113.7"),
        ("127.0.0.1", ["2001:DB8:0:0::7"], "2001:db8::7"),  # one spelling of each address
        ("127.0.0.1", ["2001:db8:ffff::1, 2001:db8::7"], "2001:db8::7"),
        # a hop that names no address ends the walk at the last trusted hop
        ("127.0.0.1", ["unknown"], "127.0.0.1"),
        ("127.0.0.1", ["203.0.113.7, garbage"], "127.0.0.1"),
        ("127.0.0.1", ["203.0.113.7, 10.0.0.5, ,"], "127.0.0.1"),
        ("127.0.0.1", ["garbage, 10.0.0.5"], "10.0.0.5"),
        ("127.0.0.1", ["[2001:db8::7"], "127.0.0.1"),
        ("127.0.0.1", ["1" * 5000], "127.0.0.1"),
        # what a client writes sits left of its proxy's hop and is never reached
        ("127.0.0.1", ["10.0.0.9, 127.0.0.1, 203.0.113.7"], "203.0.113.7"),
    ],
)
def test_x_forwarded_for(peer: str, values: list[str], expected: str) -> None:
    assert client_address(peer, values, PROXIES) == expected


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (["for=203.0.113.7"], "203.0.113.7"),
        (['for="[2001:db8::7]:4711";proto=https'], "2001:db8::7"),
        (["for=198.51.100.1, For=203.0.113.7;by=10.0.0.1"], "203.0.113.7"),
        (["proto=https"], "127.0.0.1"),  # an element without `for`
        (["for=_hidden"], "127.0.0.1"),  # an obfuscated node
        (["for=unknown"], "127.0.0.1"),
        # an unbalanced quote of the client's cannot swallow its proxy's element
        (['for="198.51.100.1', "for=203.0.113.7"], "203.0.113.7"),
        (['for="198.51.100.1, for=203.0.113.7'], "203.0.113.7"),
    ],
)
def test_forwarded(values: list[str], expected: str) -> None:
    assert client_address("127.0.0.1", values, FORWARDED) == expected


def test_without_trusted_proxies_no_header_is_read() -> None:
    assert client_address("127.0.0.1", ["203.0.113.7"], TrustedProxies()) == "127.0.0.1"


def test_a_list_of_very_many_trusted_hops_stops_at_the_bound() -> None:
    hops = [f"10.0.{i // 256}.{i % 256}" for i in range(10_000)]
    got = client_address("127.0.0.1", [", ".join(["203.0.113.7", *hops])], PROXIES)
    assert got == hops[-MAX_HOPS]  # the last trusted hop walked, never the forged leftmost


@pytest.mark.parametrize(
    "entries",
    [["*"], ["0.0.0.0/0"], ["::/0"], ["10.0.0.0/33"], ["proxy.example.com"], [""]],
)
def test_trusted_proxies_that_cannot_work_are_refused_at_start(entries: list[str]) -> None:
    with pytest.raises(SettingsError, match="VISIONGATE_TRUSTED_PROXIES"):
        Settings.load({"trusted_proxies": entries}, environ={})


def test_trusted_proxies_from_the_environment() -> None:
    settings = Settings.load(
        environ={
            "VISIONGATE_TRUSTED_PROXIES": "10.0.0.0/8, ::1",
            "VISIONGATE_TRUSTED_PROXY_HEADER": "forwarded",
        }
    )
    assert settings.trusted_proxies == ["10.0.0.0/8", "::1"]
    with pytest.raises(SettingsError, match="VISIONGATE_TRUSTED_PROXY_HEADER"):
        Settings.load(environ={"VISIONGATE_TRUSTED_PROXY_HEADER": "x-real-ip"})


def test_the_address_reaches_the_logs() -> None:
    """One function decides; the log lines of a request carry its answer as `client`."""
    import httpx

    from gateway.testing.fake_gateway import captured_gateway, unit_settings

    with captured_gateway(unit_settings(trusted_proxies=["127.0.0.1"])) as gw:
        r = httpx.post(
            f"{gw.http_url}/v1/chat/completions",
            json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Forwarded-For": "198.51.100.1, 203.0.113.7"},
        )
        assert r.status_code == 404
        lines = gw.lines(event="client_error")
        assert lines and all(line["client"] == "203.0.113.7" for line in lines)
