"""Loops that run until cancelled end when cancelled, also where redis-py swallows the
cancellation."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest

from pdmesh_service.instance import InstanceInfo, Role
from pdmesh_service.redis_server import EmbeddedRedis
from pdmesh_service.registry import Registry, connect, heartbeat_forever
from pdmesh_service.tasks import pause


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as redis:
        yield redis.url


def test_pause_raises_a_cancellation_that_was_swallowed() -> None:
    async def swallowing_loop(turns: list[int]) -> None:
        while True:
            try:
                await asyncio.sleep(10)  # cancelled here; caught as a library might
            except asyncio.CancelledError:
                pass
            turns.append(1)
            await pause(0)

    async def main() -> list[int]:
        turns: list[int] = []
        task = asyncio.ensure_future(swallowing_loop(turns))
        await asyncio.sleep(0.01)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5)
        assert task in done and task.cancelled()
        return turns

    assert asyncio.run(main()) == [1]  # one turn ran on, then the cancel took effect


def test_a_heartbeat_cancelled_at_any_moment_ends(redis_url: str) -> None:
    """Cancels land anywhere in the beat, also inside redis-py's commands (which swallowed some
    before the loops paused through `pause`: about one in five beats never ended)."""
    info = InstanceInfo("kvstore-1", Role.KVSTORE, "127.0.0.1:1", ready=True)
    rng = random.Random(7)

    async def main() -> int:
        redis = connect(redis_url)
        registry, hung = Registry(redis, "t-cancel"), 0
        try:
            for _ in range(100):
                beat = asyncio.ensure_future(heartbeat_forever(registry, lambda: info, 0.002, 1.0))
                await asyncio.sleep(rng.random() * 0.01)
                beat.cancel()
                done, _ = await asyncio.wait({beat}, timeout=2)
                if beat not in done:
                    hung += 1
                    beat.cancel()
                    await asyncio.wait({beat}, timeout=2)
        finally:
            await redis.aclose()
        return hung

    assert asyncio.run(main()) == 0
