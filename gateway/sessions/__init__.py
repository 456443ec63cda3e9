"""Session stores: `memory` (embedded default) and `redis` (scale-out).

`RedisSessionStore` is imported on first use, so the memory path needs no Redis client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.sessions.memory import MemorySessionStore
from gateway.sessions.session import Session, SessionStore, StoredItem, StoredPart

if TYPE_CHECKING:
    from gateway.sessions.redis import RedisSessionStore

__all__ = (
    "MemorySessionStore",
    "RedisSessionStore",
    "Session",
    "SessionStore",
    "StoredItem",
    "StoredPart",
    "make_session_store",
)


def make_session_store(
    redis_url: str | None, ttl_s: float, *, timeout_s: float | None = None
) -> SessionStore:
    """In-process without a Redis URL (nothing survives a restart); otherwise Redis, each call
    within `timeout_s` (the store's default when None)."""
    if redis_url is None:
        return MemorySessionStore(ttl_s)
    from gateway.sessions.redis import RedisSessionStore

    if timeout_s is None:
        return RedisSessionStore(redis_url, ttl_s)
    return RedisSessionStore(redis_url, ttl_s, timeout_s=timeout_s)


def __getattr__(name: str) -> Any:
    if name == "RedisSessionStore":
        from gateway.sessions.redis import RedisSessionStore

        return RedisSessionStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
