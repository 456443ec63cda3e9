"""The token limiters under test: one per backend (in memory, a real redis-server, a real
Redis Cluster), each on its own namespace and closed after the test."""

from __future__ import annotations

import pytest

from gateway.policy.token_limits import MemoryTokenLimiter, RedisTokenLimiter


@pytest.fixture(params=["memory", "redis", "cluster"])
async def limiter_of(request):
    """`limiter_of(clock)`: a new limiter of the test's backend reading `clock`."""
    made = []

    def make(clock):
        if request.param == "memory":
            limiter = MemoryTokenLimiter(clock=clock)
        else:
            url = request.getfixturevalue(
                "redis_url" if request.param == "redis" else "redis_cluster_url"
            )
            limiter = RedisTokenLimiter(url, namespace=request.node.name[-40:], clock=clock)
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        await limiter.aclose()
