"""Per managed key, the responses it started, counted in the key store (`/v1/admin/usage`).

`CountingLimiter` wraps the rate limiter, whose `acquire(owner)` every transport calls once per
response: a response that passes is counted for its owner when that owner is a managed key.
Counts are written in the background (a store that is slow or down never delays a response;
a count lost that way is logged). Token counts are not kept yet: they are known in the chat
layer, after the answer, and nothing reports them to the policy layer so far.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from gateway.policy.auth import Authenticator
    from gateway.policy.ratelimit import RateLimiter

__all__ = ("CountingLimiter",)

log = structlog.get_logger("visiongate.key_usage")
MAX_PENDING = 1000  # counts in flight; past that they are dropped (and logged), not queued


class CountingLimiter:
    __slots__ = ("_pending", "auth", "inner")

    def __init__(self, inner: RateLimiter, auth: Authenticator) -> None:
        self.inner = inner
        self.auth = auth
        self._pending: set[asyncio.Task[None]] = set()

    async def acquire(self, owner: str) -> None:
        await self.inner.acquire(owner)
        store = self.auth.store
        if store is None or self.auth.limits_of(owner) is None:
            return
        if len(self._pending) >= MAX_PENDING:
            log.warning("key_usage_dropped", key_id=owner)
            return
        task = asyncio.create_task(self._count(owner))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _count(self, owner: str) -> None:
        try:
            async with asyncio.timeout(2.5):
                await self.auth.store.count_usage(owner, requests=1)  # type: ignore[union-attr]
        except Exception as exc:
            log.warning("key_usage_lost", key_id=owner, error=type(exc).__name__)

    async def aclose(self) -> None:
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
        await self.inner.aclose()
