"""The Redis setting: one node or a Redis Cluster, parsed and checked before any connection."""

from __future__ import annotations

import pytest

from encoder_worker.redis_conn import (
    REDIS_FAILURES,
    async_client,
    is_cluster_url,
    parse_redis_url,
    redacted,
    sync_client,
)
from gateway.settings import Settings, SettingsError


def test_single_node_urls_pass_through() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://h:6380/2", "unix:///run/redis.sock"):
        target = parse_redis_url(url)
        assert not target.cluster and target.url == url and not is_cluster_url(url)


def test_cluster_url_with_seeds_credentials_and_options() -> None:
    target = parse_redis_url("redis+cluster://app:s%40cret@10.0.0.1:7000,10.0.0.2,[::1]:7002")
    assert target.cluster and not target.tls
    assert target.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
    assert (target.username, target.password) == ("app", "s@cret")
    tls = parse_redis_url("rediss+cluster://h:7000/0?socket_keepalive=true")
    assert tls.tls and tls.nodes == (("h", 7000),) and "socket_keepalive=true" in tls.url
    assert is_cluster_url("REDIS+CLUSTER://h:1")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+cluster://h:7000/3", "only database 0"),
        ("redis+cluster://", "at least one host"),
        ("redis+cluster://h:notaport", "bad port"),
        ("http://h:6379", "scheme must be one of"),
        ("h:6379", "must look like"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_redis_url(url)


def test_query_options_and_ipv6_seeds_survive_parsing() -> None:
    target = parse_redis_url(
        "rediss+cluster://h:7000?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem"
    )
    assert target.url.endswith("?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem")
    import redis.asyncio

    assert isinstance(async_client("redis+cluster://[::1]:7000"), redis.asyncio.RedisCluster)
    unencoded = parse_redis_url("redis+cluster://u:s3cr/et?x@10.0.0.1:7000,h2:7001")
    assert unencoded.password == "s3cr/et?x" and unencoded.nodes[0] == ("10.0.0.1", 7000)


def test_passwords_never_reach_messages() -> None:
    assert redacted("redis://user:hunter2@h:1/0") == "redis://user:***@h:1/0"
    assert redacted("redis+cluster://:hunter2@a:1,b:2") == "redis+cluster://:***@a:1,b:2"
    assert redacted("redis://h:1/0") == "redis://h:1/0"
    assert redacted("redis://u:pa/ss@h:1/0") == "redis://u:***@h:1/0"
    for url in (
        "http://user:hunter2@h:1",
        "redis://user:hun/ter2@host",
        "redis+cluster://u:hunter2@h:notaport",
        "redis+cluster://u:hun/ter2@h:7000/5",
    ):
        with pytest.raises(ValueError) as info:
            parse_redis_url(url)
        assert "hun" not in str(info.value) and "ter2" not in str(info.value), str(info.value)


def test_settings_take_cluster_urls_and_refuse_bad_ones() -> None:
    assert Settings(redis_url="redis+cluster://a:7000,b:7001").redis_url.startswith("redis+")
    with pytest.raises(SettingsError, match="only database 0"):
        Settings(redis_url="redis+cluster://a:7000/1")
    with pytest.raises(SettingsError, match="REDIS_URL: Redis URL scheme must be one of"):
        Settings(redis_url="memcached://a:1")


def test_clients_of_each_kind_and_one_error_family() -> None:
    import redis
    import redis.asyncio
    from redis.exceptions import RedisClusterException, RedisError

    assert isinstance(sync_client("redis://127.0.0.1:1/0"), redis.Redis)
    assert isinstance(async_client("redis://127.0.0.1:1/0"), redis.asyncio.Redis)
    # the cluster client is built lazily: no connection is made until the first command
    client = async_client("redis+cluster://127.0.0.1:1", socket_timeout=1.0, retry_on_timeout=True)
    assert isinstance(client, redis.asyncio.RedisCluster)
    assert not issubclass(RedisClusterException, RedisError)  # why REDIS_FAILURES holds both
    assert RedisClusterException in REDIS_FAILURES and RedisError in REDIS_FAILURES
