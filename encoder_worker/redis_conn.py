"""Redis connections for gateways and encoder workers: one node, or a Redis Cluster.

Every Redis client of the project is built here from one URL setting:

    redis://[user:password@]host:port/db     one Redis (also rediss:// for TLS, unix:///path)
    redis+cluster://[user:password@]host:port[,host:port...]
                                             a Redis Cluster, given one or more seed nodes (also
                                             rediss+cluster:// for TLS); the rest are discovered

A cluster has only database 0, so a cluster URL naming another one is refused. Query options
are those redis-py reads from a URL (for example `?socket_keepalive=true`) and apply to every
node's connections; the asyncio cluster client ignores the few it has no use for (such as
`retry_on_timeout`, which its `retry` replaces).

On a cluster, a command that names keys in more than one hash slot fails (CROSSSLOT). The key
layout (`encoder_worker.storage`, the session store) is made so that nothing needs that: keys
that change together share a hash tag, and everything else is one key per command.

redis-py raises two families of errors: `RedisError` (what a server or a connection said) and,
from its cluster client, `RedisClusterException`, which is not a `RedisError`. `REDIS_FAILURES`
holds both, with the OS-level ones, so callers catch them alike.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from redis.exceptions import RedisClusterException, RedisError

if TYPE_CHECKING:
    import redis
    import redis.asyncio

__all__ = (
    "CLUSTER_SCHEMES",
    "REDIS_FAILURES",
    "RedisTarget",
    "async_client",
    "is_cluster_url",
    "parse_redis_url",
    "redacted",
    "sync_client",
)

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
_SINGLE_SCHEMES = ("redis", "rediss", "unix")

REDIS_FAILURES: tuple[type[BaseException], ...] = (
    RedisError,
    RedisClusterException,
    OSError,
    asyncio.TimeoutError,
)


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed Redis setting: `nodes` are the cluster's seeds, `url` the single node's URL."""

    cluster: bool
    url: str  # single node: the URL as given; cluster: a redis:// URL with the options only
    nodes: tuple[tuple[str, int], ...] = ()
    username: str | None = None
    password: str | None = None
    tls: bool = False


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def redacted(url: str) -> str:
    """The URL with any credentials replaced by `***`, for logs and error messages."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    userinfo, at, tail = rest.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***{at}{tail}" if ":" in userinfo else f"{scheme}://***{at}{tail}"


def parse_redis_url(url: str) -> RedisTarget:
    """Checks the setting's form; raises ValueError saying what is wrong. No message quotes the
    credentials, even a password that was not percent-encoded as URLs require."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(
            "Redis URL must look like redis://host:port/db or redis+cluster://host:port[,...]"
        )
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if scheme in _SINGLE_SCHEMES:
        _check_single(url)
        return RedisTarget(cluster=False, url=url)
    if scheme not in CLUSTER_SCHEMES:
        raise ValueError(
            f"Redis URL scheme must be one of {', '.join(_SINGLE_SCHEMES + CLUSTER_SCHEMES)}, "
            f"got {scheme[:20]!r}"
        )
    userinfo, _, rest = rest.rpartition("@")  # the last @: a password may hold / ? or @
    rest, _, query = rest.partition("?")  # the query first: option values may hold a /
    hosts, _, path = rest.partition("/")
    username = password = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    if path.strip("/") not in ("", "0"):
        raise ValueError(
            f"a Redis Cluster has only database 0; the URL names database {path.strip('/')[:20]!r}"
        )
    nodes: list[tuple[str, int]] = []
    for part in hosts.split(","):
        if not part.strip():
            continue
        parsed = urlsplit(f"//{part.strip()}")
        try:
            port = parsed.port or 6379
        except ValueError:
            raise ValueError(f"bad port in Redis Cluster node {part.strip()[:60]!r}") from None
        if not parsed.hostname:
            raise ValueError(f"Redis Cluster node {part.strip()[:60]!r} has no host")
        nodes.append((parsed.hostname, port))
    if not nodes:
        raise ValueError("a redis+cluster:// URL needs at least one host:port")
    tls = scheme == "rediss+cluster"
    # only the options are read from this URL (host, port and db are dropped), so any host does
    options_url = f"{'rediss' if tls else 'redis'}://localhost/0"
    if query:
        options_url += f"?{query}"
    return RedisTarget(
        cluster=True,
        url=options_url,
        nodes=tuple(nodes),
        username=username,
        password=password,
        tls=tls,
    )


def _check_single(url: str) -> None:
    """What redis-py itself would refuse in a one-node URL, said without the credentials."""
    from redis.connection import parse_url

    try:
        parse_url(url)
    except ValueError as exc:
        message = str(exc)
        if "@" in url:  # redis-py's message may quote a piece of the password
            message = "it does not parse; percent-encode any / ? # @ or : in the password"
        raise ValueError(f"bad Redis URL {redacted(url)!r}: {message}") from None


# On a MOVED reply redis-py's cluster clients patch their slot map, and every few MOVED replies
# (by default) also close all of the client's connections to rebuild it, including those other
# commands are using at that moment: under concurrency (a fresh client's first burst, a slot
# migration) those commands then fail. Patching alone is enough to follow a resharding, so the
# clients here never close on MOVED; a failover (CLUSTER DOWN) still rebuilds the map.
_MOVED_PATCHES: dict[str, Any] = {"reinitialize_steps": 0}


def _default_retry(options: dict[str, Any], asyncio_client: bool) -> dict[str, Any]:
    """One quick retry unless the caller chose: redis-py's own default (3 retries with jittered
    backoff up to 10 s, each after a cluster rediscovery) holds a request for ~25 s while a
    master is unreachable, where the callers here would rather fail fast and fall back."""
    if "retry" in options:
        return options
    from redis.backoff import ExponentialBackoff

    if asyncio_client:
        from redis.asyncio.retry import Retry
    else:
        from redis.retry import Retry
    return {**options, "retry": Retry(ExponentialBackoff(cap=0.25, base=0.05), 1)}


def _url_options(target: RedisTarget) -> dict[str, Any]:
    """The connection options a cluster URL's query string carries, as redis-py reads them."""
    from redis.connection import parse_url

    options = parse_url(target.url)
    for key in ("host", "port", "db", "username", "password", "connection_class", "path"):
        options.pop(key, None)
    return options


def _accepted(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """The options the asyncio cluster client takes (it has no catch-all for the rest, such as
    `retry_on_timeout`, which its own `retry` replaces)."""
    import inspect

    names = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in options.items() if k in names}


def async_client(url: str, **options: Any) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
    """An asyncio client for the URL: `redis.asyncio.Redis` or `redis.asyncio.RedisCluster`.

    `options` are connection options (timeouts, `decode_responses`, `retry`); on a cluster they
    apply to each node's connections. Both clients answer the commands this project uses alike;
    on a cluster, keys in one command must share a slot."""
    target = parse_redis_url(url)
    if not target.cluster:
        from redis.asyncio import Redis

        return Redis.from_url(url, **_default_retry(options, True))
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    options = _default_retry(options, True)
    kwargs = _accepted(RedisCluster, {**_MOVED_PATCHES, **_url_options(target), **options})
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
        username=target.username,
        password=target.password,
        ssl=target.tls,
        **kwargs,
    )


def sync_client(url: str, **options: Any) -> redis.Redis | redis.RedisCluster:
    """The blocking counterpart of `async_client` (for threads that are not on an event loop)."""
    target = parse_redis_url(url)
    if not target.cluster:
        import redis

        return redis.Redis.from_url(url, **_default_retry(options, False))
    from redis.cluster import ClusterNode, RedisCluster

    options = _default_retry(options, False)
    kwargs = {**_MOVED_PATCHES, **_url_options(target), **options}
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
        username=target.username,
        password=target.password,
        ssl=target.tls,
        **kwargs,
    )
