"""`/readyz`: whether this gateway can serve a request now, and if not, what it is missing.

Ready means all of:

    model           the engine and encoder are loaded and warmed up
    redis           the configured Redis answers PING (only when `redis_url` is set); a Redis
                    Cluster: every master answers and reports `cluster_state:ok`
    encoder_workers with `encoder=redis`: at least one worker of the deployment serving this
                    gateway's encoder fingerprint has sent a heartbeat within `WORKER_LIVE_S`
                    (unknown, so missing, while Redis is down)

Ready answers 200 `{"status": "ready", "model": ...}` (with `encoder_workers`, the live count,
under `encoder=redis`); anything else 503 with `status` "loading" (the models are loading),
"failed" (they failed to load; `error` says why) or "not_ready", and `missing` listing the
parts above that are absent.

A probe is cheap and never stalls the event loop: one check at a time, its answer reused for
`ttl_s`, and Redis asked on a fresh connection within `timeout_s` (and half that to drop the
connection; a cluster through one long-lived client, whose map of the nodes follows the
cluster), so a dead or unreachable Redis delays an answer by at most that, once per `ttl_s`,
however often the load balancer asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from gateway.server.state import GatewayState

__all__ = ("Readiness",)

log = structlog.get_logger("gateway.server.readiness")


class Readiness:
    """The `/readyz` answer for one gateway: `await check()` -> (HTTP status, body)."""

    def __init__(self, state: GatewayState, *, ttl_s: float = 1.0, timeout_s: float = 1.0) -> None:
        self._state = state
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._lock = asyncio.Lock()
        self._answer: tuple[int, dict[str, Any]] | None = None
        self._at = 0.0
        self._redis_was_up = True
        self._cluster: Any = None  # the long-lived probe client of a Redis Cluster

    async def check(self) -> tuple[int, dict[str, Any]]:
        async with self._lock:  # concurrent probes wait for the one in flight and share it
            if self._answer is None or time.monotonic() - self._at >= self.ttl_s:
                self._answer = await self._probe()
                self._at = time.monotonic()
            return self._answer

    async def _probe(self) -> tuple[int, dict[str, Any]]:
        state = self._state
        settings = state.settings
        missing: list[str] = []
        workers: int | None = None
        if not state.ready:
            missing.append("model")
        elif not state.engine.ready:  # an upstream engine with no healthy replica
            missing.append("upstreams" if settings.engine == "openai" else "model")
        if settings.redis_url is not None:
            redis_up, workers = await self._ask_redis(settings.redis_url)
            if not redis_up:
                missing.append("redis")
        if settings.encoder == "redis" and state.ready and not workers:
            missing.append("encoder_workers")
        body: dict[str, Any] = {"status": "ready", "model": state.engine.model_id}
        if settings.encoder == "redis" and workers is not None:
            body["encoder_workers"] = workers
        if not missing:
            return 200, body
        if state.load_error:
            body.update(status="failed", error=state.load_error)
        elif not state.ready:
            body["status"] = "loading"
        else:
            body["status"] = "not_ready"
        body["missing"] = missing
        return 503, body

    async def _ask_redis(self, url: str) -> tuple[bool, int | None]:
        """(Redis answers, live encoder workers or None when not asked or not known)."""
        from gateway.encoders.redis_encoder import RedisEncoder, live_workers

        serving = self._state.serving
        encoder = serving.encoder if serving is not None else None
        t = self.timeout_s
        cluster = self._cluster_client(url)
        client = cluster or self._fresh_client(url)
        up, workers = False, None
        try:
            async with asyncio.timeout(t):
                if cluster is not None:
                    await _cluster_ok(cluster)
                else:
                    await client.ping()
                up = True
                if isinstance(encoder, RedisEncoder):
                    workers = await live_workers(client, encoder.deployment, encoder.fingerprint)
        except Exception as exc:  # logged once per outage, not once per probe
            if up:
                log.warning("readyz.encoder_workers_unknown", error=repr(exc))
            elif self._redis_was_up:
                log.warning("readyz.redis_unavailable", error=repr(exc))
        finally:
            if cluster is None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(t / 2):
                        await client.aclose()
        self._redis_was_up = up
        return up, workers

    def _fresh_client(self, url: str) -> Any:
        from gateway.caching.redis_connections import async_client

        t = self.timeout_s
        return async_client(url, socket_connect_timeout=t, socket_timeout=t)

    def _cluster_client(self, url: str) -> Any:
        """A Redis Cluster is probed by one long-lived client: its map of the nodes follows the
        cluster, so the probe keeps working when the seeds named in the URL are gone."""
        from gateway.caching.redis_connections import is_cluster_url

        if not is_cluster_url(url):
            return None
        if self._cluster is None:
            self._cluster = self._fresh_client(url)
        return self._cluster

    async def aclose(self) -> None:
        if self._cluster is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.timeout_s):
                    await self._cluster.aclose()
            self._cluster = None


async def _cluster_ok(client: Any) -> None:
    """Every master answers and reports `cluster_state:ok`: a master that answers PING while it
    sees the cluster failed (a partition's minority side) refuses keyed commands all the same.
    Raises when not."""
    replies = await client.cluster_info(target_nodes="primaries")
    if isinstance(replies, dict) and "cluster_state" in replies:
        replies = {"node": replies}  # one master: the reply itself
    failed = [node for node, info in replies.items() if info.get("cluster_state") != "ok"]
    if failed or not replies:
        raise ConnectionError(f"cluster_state is not ok on {failed or 'any master'}")
