"""`--redis-url` with Redis Sentinel (`pdmesh_service.redis_client`): the URL forms and errors, and
clients against a real primary, replica and sentinel on loopback (one sentinel, quorum 1: enough on
loopback, see `tests/redis_sentinel.py`):

- kill -9 the primary under a stream of writes: the client reaches the promoted replica by itself
  and writes again within a bound (the time from the kill to the first write that succeeds is
  reported as the `recover_s` property); data replicated before the kill is still there, and a
  registry heartbeat running meanwhile has its entry on the new primary;
- a coordinated failover (SENTINEL FAILOVER): once the old primary is a replica, the client's
  commands reach the new primary, after at most one `ConnectionError` (a pooled connection to the
  old one answering READONLY).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import SentinelConnectionPool
from redis_sentinel import MASTER_NAME, SentinelDeployment

from pdmesh_service.instance import InstanceInfo
from pdmesh_service.options import CommonConfig, redacted_url
from pdmesh_service.redis_client import (
    DATA_CONNECT_TIMEOUT_S,
    DATA_TIMEOUT_S,
    SENTINEL_PORT,
    check_redis_url,
    connect,
    connect_sync,
    parse_sentinel_url,
)
from pdmesh_service.registry import Registry, heartbeat_forever

RECOVER_BOUND_S = 20.0  # down-after 1 s + sentinel's start desync (<= 1 s) + promotion, with slack
STOP_BOUND_S = 30.0  # a writer's last command: a reply timeout (10 s) and a reconnection at most
TEST_BOUND_S = (
    120.0  # a failover test that hangs fails here, with its stack, not at pytest's timeout
)


# ----- URL forms -----
def test_a_sentinel_url_names_its_sentinels_service_db_and_credentials() -> None:
    parsed = parse_sentinel_url(
        "redis+sentinel://:s3cret@h1:26380,h2,[::1]:26381/mymaster/2"
        "?sentinel_password=sp&socket_timeout=2.5"
    )
    assert parsed.sentinels == (("h1", 26380), ("h2", SENTINEL_PORT), ("::1", 26381))
    assert (parsed.service_name, parsed.db, parsed.password) == ("mymaster", 2, "s3cret")
    assert parsed.username is None and parsed.sentinel_password == "sp" and not parsed.ssl
    assert parsed.connection_kwargs() == {"db": 2, "password": "s3cret", "socket_timeout": 2.5}
    sentinel_kwargs = parsed.sentinel_kwargs({"socket_timeout": 3.0, "decode_responses": True})
    assert sentinel_kwargs["password"] == "sp" and sentinel_kwargs["socket_timeout"] == 3.0
    assert "decode_responses" not in sentinel_kwargs
    assert "s3cret" not in repr(parsed) and "'sp'" not in repr(parsed)


def test_sentinel_url_defaults_and_tls() -> None:
    parsed = parse_sentinel_url("rediss+sentinel://user:pw@10.0.0.1:5000/cache")
    assert parsed.sentinels == (("10.0.0.1", 5000),) and parsed.db == 0 and parsed.ssl
    assert (parsed.username, parsed.password) == ("user", "pw")
    assert parse_sentinel_url("redis+sentinel://h/m?db=3&password=q").connection_kwargs() == {
        "db": 3,
        "password": "q",
    }


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://:pw@h1:1/",  # no service name
        "redis+sentinel://:pw@/mymaster",  # no sentinel
        "redis+sentinel://:pw@h1:notaport/mymaster",
        "redis+sentinel://:pw@h1:70000/mymaster",
        "redis+sentinel://:pw@h1:1/mymaster/zero",
        "redis+sentinel://:pw@h1:1/mymaster/0/extra",
        "redis+sentinel://:pw@h1:1/mymaster?bogus=1",
        "http://:pw@h1:1/0",
    ],
)
def test_malformed_urls_are_refused_without_echoing_the_password(url: str) -> None:
    with pytest.raises(ValueError, match="--redis-url|Sentinel|sentinel|db") as raised:
        check_redis_url(url)
    assert "pw" not in str(raised.value)
    with pytest.raises(ValueError):
        CommonConfig(redis_url=url)


def test_services_take_sentinel_urls_and_never_show_their_passwords() -> None:
    url = "redis+sentinel://:s3cret@h1:1,h2:2/mymaster/0?sentinel_password=sp"
    config = CommonConfig(redis_url=url)
    assert "s3cret" not in repr(config) and "sp&" not in repr(config)
    assert "s3cret" not in redacted_url(url) and "=sp" not in redacted_url(url)
    assert "h1:1,h2:2/mymaster/0" in redacted_url(url)
    for plain in ("redis://127.0.0.1:6379/0", "rediss://h:1/0", "unix:///tmp/r.sock?db=1"):
        check_redis_url(plain)


def test_plain_urls_make_plain_clients_and_sentinel_urls_sentinel_clients() -> None:
    plain = connect("redis://:pw@127.0.0.1:1/3", decode_responses=True)
    assert not isinstance(plain.connection_pool, SentinelConnectionPool)
    assert plain.connection_pool.connection_kwargs["db"] == 3
    sentinel = connect("redis+sentinel://:pw@127.0.0.1:1/mymaster/4", socket_timeout=2.0)
    pool = sentinel.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "mymaster"
    kwargs = pool.connection_kwargs
    assert (kwargs["db"], kwargs["password"], kwargs["socket_timeout"]) == (4, "pw", 2.0)
    assert kwargs["socket_connect_timeout"] == DATA_CONNECT_TIMEOUT_S  # bounded by default
    bounded = connect("redis+sentinel://127.0.0.1:1/mymaster?socket_connect_timeout=0.5")
    bounded_kwargs = bounded.connection_pool.connection_kwargs
    assert bounded_kwargs["socket_timeout"] == DATA_TIMEOUT_S
    assert bounded_kwargs["socket_connect_timeout"] == 0.5
    sync = connect_sync("redis+sentinel://127.0.0.1:1/mymaster")
    assert sync.connection_pool.service_name == "mymaster"
    sync.close()


# ----- real failovers -----
@pytest.fixture
def deployment():
    with SentinelDeployment(down_after_ms=1000, failover_timeout_ms=5000) as d:
        yield d


async def _write_until(
    stop: asyncio.Event, client: aioredis.Redis, log: list[tuple[float, bool]]
) -> None:
    """SET a counter every 20 ms until `stop`, recording (time, succeeded) of each attempt. (A
    stop flag, not a cancellation: redis.asyncio on Python 3.11 can swallow a cancellation that
    lands while a connection to the new primary is being made, and the task would never end.)"""
    n = 0
    while not stop.is_set():
        n += 1
        try:
            await client.set("load:counter", n)
            log.append((time.monotonic(), True))
        except (aioredis.RedisError, OSError):
            log.append((time.monotonic(), False))
        await asyncio.sleep(0.02)


def test_a_client_survives_kill_9_of_the_primary(
    deployment: SentinelDeployment, record_property
) -> None:
    async def main() -> float:
        client = connect(deployment.url)
        registry = Registry(client, "failover")
        info = InstanceInfo("decode-1", "decode", "127.0.0.1:1", ready=True)
        try:
            await client.set("before", "kept")
            assert await client.execute_command("WAIT", 1, 5000) == 1  # on the replica too
            log: list[tuple[float, bool]] = []
            stop = asyncio.Event()
            writers = [asyncio.ensure_future(_write_until(stop, client, log)) for _ in range(4)]
            beat = asyncio.ensure_future(
                heartbeat_forever(registry, lambda: info, interval_s=0.2, ttl_s=60.0)
            )
            await asyncio.sleep(0.5)
            old = await asyncio.to_thread(deployment.kill_primary)
            killed_at = time.monotonic()
            new = await asyncio.to_thread(deployment.wait_failover, old)
            assert new is not old
            deadline = time.monotonic() + RECOVER_BOUND_S
            while not any(ok and t > killed_at for t, ok in log) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            stop.set()
            beat.cancel()
            _, pending = await asyncio.wait([*writers, beat], timeout=STOP_BOUND_S)
            assert not pending, f"{len(pending)} task(s) still running {STOP_BOUND_S}s after stop"
            recovered = [t for t, ok in log if ok and t > killed_at]
            assert recovered, f"no write succeeded within {RECOVER_BOUND_S}s of the kill"
            assert await client.get("before") == b"kept"
            assert [i.instance_id for i in await registry.instances()] == ["decode-1"]
            return recovered[0] - killed_at
        finally:
            await client.aclose()

    recover_s = asyncio.run(asyncio.wait_for(main(), TEST_BOUND_S))
    record_property("recover_s", round(recover_s, 3))
    print(f"kill -9 of the primary: the client wrote again after {recover_s:.2f}s")
    assert recover_s < RECOVER_BOUND_S


def test_a_coordinated_failover_sends_clients_to_the_new_primary(
    deployment: SentinelDeployment,
) -> None:
    async def main() -> list[str]:
        client = connect(deployment.url)
        errors: list[str] = []
        try:
            await client.set("k", "v1")  # a pooled connection to the primary
            old = deployment.current_primary()
            with deployment.sentinels[0].client() as sentinel:
                assert sentinel.sentinel_failover(MASTER_NAME)
            new = await asyncio.to_thread(deployment.wait_failover, old)
            await asyncio.to_thread(deployment.wait_role, old, "slave")
            deadline = time.monotonic() + RECOVER_BOUND_S
            while time.monotonic() < deadline:
                try:
                    await client.set("k", "v2")
                    break
                except redis.ConnectionError as e:  # READONLY from the demoted one, or a reset
                    errors.append(str(e))
                    await asyncio.sleep(0.05)
            assert await client.get("k") == b"v2"
            address = client.connection_pool.master_address
            assert address is not None and int(address[1]) == new.port
            return errors
        finally:
            await client.aclose()

    # Sentinel kills the demoted primary's client connections as it reconfigures it (so redis-py
    # reconnects, asking the sentinels, without an error); a command that still reached it would
    # get READONLY, which redis-py turns into one ConnectionError and a re-resolve.
    errors = asyncio.run(asyncio.wait_for(main(), TEST_BOUND_S))
    assert set(errors) <= {"The previous master is now a slave"} and len(errors) <= 1, errors


def test_the_sync_client_follows_a_failover_too(deployment: SentinelDeployment) -> None:
    client = connect_sync(deployment.url, socket_timeout=1.0)
    try:
        assert client.set("sync", "1")
        old = deployment.kill_primary()
        deployment.wait_failover(old)
        deadline = time.monotonic() + RECOVER_BOUND_S
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                if client.set("sync", "2"):
                    break
            time.sleep(0.05)
        assert client.get("sync") == b"2"
    finally:
        client.close()
