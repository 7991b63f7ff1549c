"""`pdmesh_service.supervision`: the restart policy (backoff, budget, reset after a healthy run),
the restart records in a real Redis, and the embedded Redis's password."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from pdmesh_service.redis_server import EmbeddedRedis
from pdmesh_service.supervision import (
    RestartPolicy,
    RestartRecord,
    RestartTracker,
    read_restarts,
    read_restarts_sync,
    record_restart,
    record_restarts_sync,
)

POLICY = RestartPolicy(max_restarts=5, window_s=600, backoff_s=0.5, max_backoff_s=10, healthy_s=60)


def test_backoff_doubles_up_to_the_cap() -> None:
    tracker, now, delays = RestartTracker(RestartPolicy(max_restarts=100)), 0.0, []
    for _ in range(8):
        delay = tracker.on_exit(now, healthy_since=None)
        assert delay is not None
        delays.append(delay)
        now += 1.0
    assert delays == [0.5, 1, 2, 4, 8, 10, 10, 10]
    assert tracker.restarts == 8


def test_the_budget_gives_up_past_max_restarts_within_the_window() -> None:
    tracker = RestartTracker(POLICY)
    for i in range(5):
        assert tracker.on_exit(float(i), None) is not None
    assert tracker.on_exit(5.0, None) is None  # the 6th exit within 10 minutes
    assert tracker.restarts == 5


def test_restarts_older_than_the_window_leave_the_budget() -> None:
    tracker = RestartTracker(POLICY)
    for i in range(5):
        assert tracker.on_exit(float(i), None) is not None
    assert tracker.on_exit(600.5, None) is not None  # the first one (at 0) left the window
    assert tracker.on_exit(600.6, None) is None  # the one at 1 is still inside
    assert tracker.restarts == 6


def test_a_healthy_run_resets_the_backoff_not_the_budget() -> None:
    tracker = RestartTracker(POLICY)
    assert [tracker.on_exit(t, None) for t in (0.0, 1.0, 3.0)] == [0.5, 1, 2]
    # SERVING since 10 s, died at 30 s: not long enough, the streak goes on
    assert tracker.on_exit(30.0, healthy_since=10.0) == 4
    # SERVING for 60 s: back to the first delay
    assert tracker.on_exit(200.0, healthy_since=140.0) == 0.5
    assert tracker.on_exit(201.0, None) is None  # still 5 restarts within the window


def test_no_restarts_means_the_first_exit_gives_up() -> None:
    tracker = RestartTracker(RestartPolicy(max_restarts=0))
    assert tracker.on_exit(0.0, None) is None and tracker.restarts == 0


@pytest.mark.parametrize(
    "bad", [dict(max_restarts=-1), dict(backoff_s=0), dict(backoff_s=20), dict(window_s=0)]
)
def test_bad_policies_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**bad)


def test_records_round_trip_through_redis() -> None:
    with EmbeddedRedis() as server:

        async def run() -> dict:
            client = aioredis.Redis.from_url(server.url)
            try:
                assert await read_restarts(client, "d1") == {}
                await record_restart(client, "d1", "decode-0", 2, -9, 1700000000000)
                await record_restart(client, "d1", "decode-0", 3, 1, 1700000001000)
                await record_restart(client, "other", "gateway-0", 1, 0, 5)
                return await read_restarts(client, "d1")
            finally:
                await client.aclose()

        assert asyncio.run(run()) == {
            "decode-0": {"restarts": 3, "last_exit_code": 1, "at_ms": 1700000001000}
        }
        sync = redis.Redis.from_url(server.url)
        record_restarts_sync(sync, "d1", {"redis": RestartRecord(1, -9, 7)})
        assert read_restarts_sync(sync, "d1")["redis"] == {
            "restarts": 1,
            "last_exit_code": -9,
            "at_ms": 7,
        }
        assert set(read_restarts_sync(sync, "d1")) == {"decode-0", "redis"}
        sync.close()


def _unauthenticated_ping(host: str, port: int) -> bytes:
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(128)


def test_embedded_redis_requires_its_password_which_stays_out_of_argv(tmp_path: Path) -> None:
    with EmbeddedRedis(log_path=tmp_path / "redis.log") as server:
        assert server.password and f":{server.password}@" in server.url
        assert server.display_url == f"redis://***@{server.host}:{server.port}/0"
        assert server.password not in repr(server)
        assert _unauthenticated_ping(server.host, server.port).startswith(b"-NOAUTH")
        assert redis.Redis.from_url(server.url).ping()
        assert server.process is not None
        cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
        assert server.password.encode() not in cmdline


def test_embedded_redis_comes_back_on_its_port_with_its_password() -> None:
    with EmbeddedRedis() as server:
        assert server.process is not None
        first = server.process
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        assert not server.is_ready()
        server.spawn()
        deadline = time.monotonic() + 10
        while not server.is_ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.process.pid != first.pid and server.is_ready()
        assert _unauthenticated_ping(server.host, server.port).startswith(b"-NOAUTH")


def test_an_embedded_redis_without_password_is_open() -> None:
    with EmbeddedRedis(password="") as server:
        assert server.url == f"redis://{server.host}:{server.port}/0" == server.display_url
        assert _unauthenticated_ping(server.host, server.port).startswith(b"+PONG")
