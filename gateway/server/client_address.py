"""The client address of a request: the TCP peer, or, from a trusted proxy, the hop it names.

`client_address` is the one function that decides it, and `ClientAddressMiddleware` writes its
answer into the ASGI scope's `client` before anything else reads it, so the admin-key lockout,
the log lines (`client`) and the spans (`client.address`) all see the same address.

By default no header is believed: uvicorn's own proxy-header handling is turned off
(gateway/server/runner.py), and the address is the TCP peer's. With `trusted_proxies` (addresses
and CIDRs), a request whose peer is one of them is read from `X-Forwarded-For` (or RFC 7239
`Forwarded`, `trusted_proxy_header`): the list is walked from its right end, past every hop that
is itself a trusted proxy, and the first hop that is not is the client (the rightmost untrusted
hop: what a client writes itself sits to its left and is never reached). A hop that is not an
address (`unknown`, an obfuscated `_name`, garbage) ends the walk at the last trusted hop, as
does a list longer than `MAX_HOPS` trusted hops: those clients then share that proxy's address.
Several header lines are one list, in order. Commas split hops without regard to quotes, so a
client's unbalanced quote cannot swallow the hops its proxies appended.

Addresses are normalized: an IPv4-mapped IPv6 address (`::ffff:192.0.2.1`) is its IPv4 address,
an IPv6 zone (`%eth0`) is dropped.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from litestar.types import ASGIApp, Receive, Scope, Send

__all__ = (
    "MAX_HOPS",
    "ClientAddressMiddleware",
    "TrustedProxies",
    "client_address",
    "normalize_address",
    "parse_networks",
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_HOPS = 32  # trusted hops walked at most; past them the last trusted one is the client
HEADERS = ("x-forwarded-for", "forwarded")


def _address(text: str) -> IPAddress | None:
    """An address from a hop as proxies write it: `192.0.2.1`, `192.0.2.1:8080`,
    `2001:db8::1`, `[2001:db8::1]`, `[2001:db8::1]:8080`, with a zone or not; None otherwise."""
    text = text.strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            return None
        text = text[1:end]
    elif text.count(":") == 1:  # IPv4 with a port
        text = text.partition(":")[0]
    text = text.partition("%")[0]  # a zone names the interface, not the host
    if not text or len(text) > 45:
        return None
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def normalize_address(text: str) -> str:
    """The text of an address in one form (mapped IPv6 -> IPv4, no zone, compressed IPv6);
    a peer that is no IP address (a Unix socket's path) is kept as it is."""
    address = _address(text)
    return str(address) if address is not None else text


def parse_networks(entries: Iterable[str]) -> tuple[Network, ...]:
    """The networks of `trusted_proxies` entries (an address is its own /32 or /128). ValueError
    naming the entry that is no address or CIDR, or that trusts every address (a /0)."""
    networks = []
    for entry in entries:
        try:
            network = ipaddress.ip_network(entry.strip(), strict=False)
        except ValueError:
            raise ValueError(f"{entry!r} is not an IP address or CIDR") from None
        if network.prefixlen == 0:
            raise ValueError(f"{entry!r} trusts every address: any client could name its own")
        if isinstance(network, ipaddress.IPv6Network):
            mapped = network.network_address.ipv4_mapped
            if mapped is not None and network.prefixlen >= 96:
                network = ipaddress.IPv4Network(f"{mapped}/{network.prefixlen - 96}", strict=False)
        networks.append(network)
    return tuple(networks)


class TrustedProxies:
    """The proxies whose forwarding header is believed, and which header that is."""

    __slots__ = ("header", "networks")

    def __init__(self, entries: Sequence[str] = (), header: str = "x-forwarded-for") -> None:
        if header not in HEADERS:
            raise ValueError(f"the forwarding header must be one of {', '.join(HEADERS)}")
        self.networks = parse_networks(entries)
        self.header = header

    def __bool__(self) -> bool:
        return bool(self.networks)

    def trusts(self, address: IPAddress) -> bool:
        return any(address in network for network in self.networks)


def _hops(values: Sequence[str], header: str) -> list[str]:
    """The hops of the header's lines, leftmost first, each as its address text."""
    hops = []
    for element in ",".join(values).split(","):
        if header == "x-forwarded-for":
            hops.append(element)
            continue
        found = ""  # Forwarded: the element's `for=` parameter, quoted or not
        for pair in element.split(";"):
            name, eq, value = pair.partition("=")
            if eq and name.strip().lower() == "for":
                found = value.strip().strip('"')
                break
        hops.append(found)
    return hops


def client_address(peer: str, header_values: Sequence[str], trusted: TrustedProxies) -> str:
    """The client of a request whose TCP peer is `peer` and whose forwarding header (the one
    `trusted` names) had `header_values` (one per header line, in order). See the module."""
    peer_address = _address(peer)
    if peer_address is None:
        return peer
    if not trusted or not trusted.trusts(peer_address) or not header_values:
        return str(peer_address)
    client = peer_address
    hops = _hops(header_values, trusted.header)
    for walked, hop in enumerate(reversed(hops)):
        if walked >= MAX_HOPS:
            break
        address = _address(hop)
        if address is None:  # the trusted proxy named no address: it is the client we know
            break
        client = address
        if not trusted.trusts(address):
            break
    return str(client)


class ClientAddressMiddleware:
    """Pure ASGI, outside the app: puts `client_address`'s answer in the scope's `client`
    (port 0 when it came from a header) and binds it as `client` on the request's log lines."""

    __slots__ = ("_header", "app", "trusted")

    def __init__(self, app: ASGIApp, trusted: TrustedProxies) -> None:
        self.app = app
        self.trusted = trusted
        self._header = trusted.header.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        peer = scope.get("client")
        host, port = (peer[0], peer[1]) if peer else ("", 0)
        values = (
            [v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == self._header]
            if self.trusted
            else []
        )
        if not host:  # no peer known (a test client): nothing to bind
            await self.app(scope, receive, send)
            return
        client = client_address(host, values, self.trusted)
        scope["client"] = (client, port if client == normalize_address(host) else 0)
        with structlog.contextvars.bound_contextvars(client=client):
            await self.app(scope, receive, send)
