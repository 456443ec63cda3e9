"""The OpenAI-compatible HTTP API (`/v1/chat/completions`, models, images, sessions) and the
web playground at `/`.

`protocol` holds the wire Structs, `chat` and `resources` the serving layer (errors returned as
values), `routes` the thin Litestar handlers that map them to HTTP.
"""

from __future__ import annotations

from gateway.api.openai.routes import http_route_handlers

__all__ = ("http_route_handlers",)
