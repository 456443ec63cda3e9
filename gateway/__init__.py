"""visiongate: a streaming chat gateway for vision-language models
with session-aware vision caching.

The public names load lazily, so `import gateway` stays cheap (no torch until it is needed):
`create_app` and `Settings` build the service, `RealtimeClient` (async) and `Client`
(blocking, resuming) talk to it over WebSocket.
"""

from __future__ import annotations

from typing import Any

__all__ = ("Client", "RealtimeClient", "Settings", "create_app")
__version__ = "0.1.0"

_WHERE = {
    "create_app": "gateway.server.app",
    "Settings": "gateway.settings",
    "RealtimeClient": "gateway.sdk.client",
    "Client": "gateway.sdk.resuming_client",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'gateway' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
