"""API keys -> owner ids. With no keys configured every caller is the owner "anonymous"."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from gateway.protocol.errors import GatewayError

__all__ = ("Authenticator",)


class Authenticator:
    __slots__ = ("_owners",)

    def __init__(self, api_keys: list[str]) -> None:
        # the owner id is a hash of the key: stable across restarts, never the key itself
        self._owners = {key: "key_" + hashlib.sha256(key.encode()).hexdigest()[:16] for key in api_keys}

    @property
    def enabled(self) -> bool:
        return bool(self._owners)

    def owner(self, headers: Mapping[str, str], query: Mapping[str, str] | None = None) -> str:
        """The caller's owner id from `Authorization: Bearer <key>`, or `?api_key=` where a query
        is passed: only for the WebSocket, which browsers cannot give headers and which is kept
        out of traced URLs (a key in an HTTP query string would be recorded in request spans)."""
        if not self._owners:
            return "anonymous"
        auth = headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else (query or {}).get("api_key", "")
        for known, owner in self._owners.items():
            if key and hmac.compare_digest(key, known):
                return owner
        raise GatewayError("unauthorized", "missing or unknown API key")
