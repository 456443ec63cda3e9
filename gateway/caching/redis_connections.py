"""The gateway's one way to Redis: every Redis client of the gateway is made through here.

The vision cache and image store tiers, the session store and its response records, the rate
limiter, the engine's KV store, the encoder queue and `/readyz` all build their clients, check
their URL setting and catch Redis failures with the names below, and this is the only gateway
module that imports `encoder_worker.redis_conn` (tests/project/test_package_layout.py holds it
to that).

Why the rules live in the encoder worker and not here: gateways and encoder workers share one
Redis (one node or a Redis Cluster) through one URL setting, so both must parse that URL, refuse
the same bad ones and build their cluster clients the same way (no database but 0, the same
retry and MOVED handling). The worker runs without the gateway installed and never imports it,
so the rules are written once in `encoder_worker.redis_conn` and the gateway reads them through
this module; the gateway adds nothing of its own to them.
"""

from __future__ import annotations

from encoder_worker.redis_conn import (
    REDIS_FAILURES,
    RedisTarget,
    async_client,
    is_cluster_url,
    parse_redis_url,
    redacted,
    sync_client,
)

__all__ = (
    "REDIS_FAILURES",
    "RedisTarget",
    "async_client",
    "is_cluster_url",
    "parse_redis_url",
    "redacted",
    "sync_client",
)
