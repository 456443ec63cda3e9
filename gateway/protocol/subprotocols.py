"""The WebSocket subprotocols `/v1/realtime` speaks, and the one that only carries a key.

`visiongate.v1.msgpack` frames events as msgpack binary messages; `realtime` is the Realtime
API's JSON text. A browser cannot set headers on a WebSocket, so it may offer its API key as a
subprotocol `openai-insecure-api-key.<key>`: accepted as a credential, never echoed back.
"""

from __future__ import annotations

__all__ = ("KEY_SUBPROTOCOL_PREFIX", "MSGPACK_SUBPROTOCOL", "REALTIME_SUBPROTOCOL")

MSGPACK_SUBPROTOCOL = "visiongate.v1.msgpack"
REALTIME_SUBPROTOCOL = "realtime"
KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
