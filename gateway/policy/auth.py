"""API keys -> owner ids. With no keys configured every caller is the owner "anonymous".

A key travels in a header only: `Authorization: Bearer <key>` (HTTP and WebSocket), or, for
browsers, which cannot set headers on a WebSocket, in the Realtime API's subprotocol form
`Sec-WebSocket-Protocol: realtime, openai-insecure-api-key.<key>`. The connection is then
accepted with a subprotocol that carries no key (`public_subprotocol`), so the key is never
echoed. A key in a URL (`?api_key=`) is refused: URLs end up in access logs, proxies and
browser history.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

from gateway.protocol.errors import GatewayError
from gateway.protocol.subprotocols import (
    KEY_SUBPROTOCOL_PREFIX,
    MSGPACK_SUBPROTOCOL,
    REALTIME_SUBPROTOCOL,
)

__all__ = (
    "KEY_SUBPROTOCOL_PREFIX",
    "QUERY_KEY_REFUSED",
    "REALTIME_SUBPROTOCOL",
    "Authenticator",
    "public_subprotocol",
)

# the WebSocket close reason (1008) for `?api_key=`
QUERY_KEY_REFUSED = "pass the API key in the Authorization header or the subprotocol"


def public_subprotocol(offered: Iterable[str]) -> str | None:
    """The subprotocol to accept a WebSocket with: the msgpack one when offered, else
    `realtime` when offered, else none. Never one of the offered values that carries a key."""
    offered = list(offered)
    for name in (MSGPACK_SUBPROTOCOL, REALTIME_SUBPROTOCOL):
        if name in offered:
            return name
    return None


def _subprotocol_key(offered: Iterable[str]) -> str:
    for name in offered:
        if name.startswith(KEY_SUBPROTOCOL_PREFIX):
            return name[len(KEY_SUBPROTOCOL_PREFIX) :]
    return ""


class Authenticator:
    __slots__ = ("_owners",)

    def __init__(self, api_keys: list[str]) -> None:
        # the owner id is a hash of the key: stable across restarts, never the key itself
        self._owners = {
            key: "key_" + hashlib.sha256(key.encode()).hexdigest()[:16] for key in api_keys
        }

    @property
    def enabled(self) -> bool:
        return bool(self._owners)

    def owner(self, headers: Mapping[str, str], subprotocols: Iterable[str] = ()) -> str:
        """The caller's owner id from `Authorization: Bearer <key>`, else (WebSocket only) from
        an offered `openai-insecure-api-key.<key>` subprotocol. GatewayError(unauthorized) when
        keys are configured and neither carries a known one; the message never holds the key."""
        if not self._owners:
            return "anonymous"
        auth = headers.get("authorization", "")
        if auth:
            scheme, _, value = auth.partition(" ")
            key = value.strip() if scheme.lower() == "bearer" else ""
        else:
            key = _subprotocol_key(subprotocols)
        found = None
        # compare against every key so the time taken does not tell which prefix matched
        for known, owner in self._owners.items():
            if key and hmac.compare_digest(key.encode(), known.encode()):
                found = owner
        if found is None:
            raise GatewayError("unauthorized", "missing or unknown API key")
        return found
