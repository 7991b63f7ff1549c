"""Service registry in Redis: one key per instance rank, refreshed by heartbeats, gone on silence.

Key: `pdmesh:{deployment}:instance:{instance_id}` → JSON of `InstanceInfo`
(`pdmesh_service.instance`, re-exported here with `Load` and `Role`), with a TTL a few times the
heartbeat interval, so an instance that stops heartbeating drops out of routing by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import redis.asyncio as aioredis

from pdmesh_service.instance import InstanceInfo, Load, Role
from pdmesh_service.logging import get_logger

__all__ = [
    "InstanceInfo",
    "Load",
    "Registry",
    "Role",
    "connect",
    "heartbeat_forever",
    "namespace",
    "stay_registered",
]
log = get_logger(__name__)


def namespace(deployment: str) -> str:
    return f"pdmesh:{deployment}"


class Registry:
    def __init__(self, client: aioredis.Redis, deployment: str = "default") -> None:
        self.client, self.prefix = client, namespace(deployment)

    def key(self, instance_id: str) -> str:
        return f"{self.prefix}:instance:{instance_id}"

    async def publish(self, info: InstanceInfo, ttl_s: float) -> None:
        stamped = replace(info, updated_ms=int(time.time() * 1000))
        await self.client.set(self.key(info.instance_id), stamped.to_json(), px=int(ttl_s * 1000))

    async def remove(self, instance_id: str) -> None:
        await self.client.delete(self.key(instance_id))

    async def instances(self, role: Role | None = None) -> list[InstanceInfo]:
        """Live instances (optionally of one role), sorted by id."""
        keys = [
            k async for k in self.client.scan_iter(match=f"{self.prefix}:instance:*", count=200)
        ]
        if not keys:
            return []
        found = [InstanceInfo.from_json(v) for v in await self.client.mget(keys) if v is not None]
        return sorted(
            (i for i in found if role is None or i.role == role), key=lambda i: i.instance_id
        )


async def _reported(report: Callable[[], Awaitable[InstanceInfo] | InstanceInfo]) -> InstanceInfo:
    info = report()
    return info if isinstance(info, InstanceInfo) else await info


async def heartbeat_forever(
    registry: Registry,
    report: Callable[[], Awaitable[InstanceInfo] | InstanceInfo],
    interval_s: float = 1.0,
    ttl_s: float = 3.0,
) -> None:
    """Publish `report()` every interval until cancelled; Redis hiccups are logged, not fatal."""
    while True:
        try:
            await registry.publish(await _reported(report), ttl_s)
        except (aioredis.RedisError, OSError) as e:
            log.warning("heartbeat failed", error=str(e))
        await asyncio.sleep(interval_s)


async def stay_registered(
    stack: contextlib.AsyncExitStack,
    registry: Registry,
    report: Callable[[], Awaitable[InstanceInfo] | InstanceInfo],
    heartbeat_s: float,
) -> None:
    """Heartbeat `report()` (TTL: three beats) until `stack` closes, which stops the beat and
    removes the entry."""
    info = await _reported(report)
    stack.push_async_callback(registry.remove, info.instance_id)
    await registry.publish(info, 3 * heartbeat_s)
    task = asyncio.ensure_future(heartbeat_forever(registry, report, heartbeat_s, 3 * heartbeat_s))

    async def stop() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    stack.push_async_callback(stop)


def connect(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, decode_responses=False)
