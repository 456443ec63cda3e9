"""The gateway's state: one typed object that every route and connection reaches.

`create_app` builds it from `Settings` (stores, auth, rate limiter, telemetry) and its lifespan
loads the models in the background; `serving` is set once they are loaded and warmed up, and
until then `require()` raises the one `busy` answer that both transports send. Nothing here
imports a transport, so the WebSocket and HTTP layers (and the app that wires them) all depend
on this module, never on each other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.policy.ratelimit import RefusedBytes
from gateway.protocol.errors import GatewayError

if TYPE_CHECKING:
    from encoder_worker.types import Encoder
    from gateway.api.admin.lockout import Lockout
    from gateway.caching import ImageStore, VisionCache
    from gateway.chat.service import ChatService
    from gateway.chat.vision_resolver import VisionResolver
    from gateway.engine.interface import Engine
    from gateway.policy.auth import Authenticator
    from gateway.policy.key_usage import CountingLimiter, TokenMeter
    from gateway.sessions.response_records import ResponseStore
    from gateway.sessions.session import SessionStore
    from gateway.settings import Settings
    from gateway.telemetry import GatewayMetrics, Telemetry

__all__ = ("NOT_READY_MESSAGE", "GatewayState", "Serving", "not_ready")

NOT_READY_MESSAGE = "the model is still loading; retry when /readyz answers 200"


def not_ready() -> GatewayError:
    """The answer to any request that needs the models before they are loaded."""
    return GatewayError("busy", NOT_READY_MESSAGE)


@dataclass(frozen=True, slots=True)
class Serving:
    """The parts that exist once the models are loaded."""

    encoder: Encoder
    vision: VisionResolver
    service: ChatService


@dataclass(eq=False)
class GatewayState:
    settings: Settings
    engine: Engine
    sessions: SessionStore
    vision_cache: VisionCache
    images: ImageStore
    auth: Authenticator
    # the request rate limit, then the token limits' room, each request counted
    rate_limiter: CountingLimiter
    telemetry: Telemetry
    responses: ResponseStore  # stored responses of the Responses API
    # per key, body bytes of refused requests over the last minute (gateway/api/http/body_guard.py)
    refused: RefusedBytes = field(default_factory=lambda: RefusedBytes(0))
    # managed keys' token limits and usage (gateway/policy/key_usage.py); None: no key store
    token_meter: TokenMeter | None = None
    # wrong admin keys counted per client (gateway/api/admin/lockout.py); None: no admin API
    admin_lockout: Lockout | None = None
    # set by `gateway.server.runner.serve` (a process of its own): freeze the startup heap once
    # ready
    freeze_gc: bool = False
    serving: Serving | None = None
    load_error: str | None = None
    started_at: float = field(default_factory=time.time)

    @property
    def ready(self) -> bool:
        return self.serving is not None

    @property
    def metrics(self) -> GatewayMetrics:
        return self.telemetry.metrics

    def require(self) -> Serving:
        """The loaded parts, or GatewayError("busy") while the models load."""
        if self.serving is None:
            raise not_ready()
        return self.serving
