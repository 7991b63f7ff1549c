"""Service registry in Redis: one key per instance rank, refreshed by heartbeats, gone on silence.

Key: `pdmesh:{deployment}:instance:{instance_id}` → JSON of `InstanceInfo`
(`pdmesh_service.instance`, re-exported here with `Load` and `Role`), with a TTL of `TTL_BEATS`
heartbeat intervals, so an instance that stops heartbeating drops out of routing by itself, while
heartbeats that come late under CPU load (seen up to three intervals late) do not.

A heartbeat that finds its key gone (Redis restarted and lost everything, or the TTL lapsed) calls
`on_missing`: what a service published once at start (a worker's NIXL agent metadata) is published
again, so a Redis restart is survived without restarting anybody.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import redis.asyncio as aioredis

from pdmesh_service import redis_client
from pdmesh_service.errors import MeshError
from pdmesh_service.instance import InstanceInfo, Load, Role
from pdmesh_service.logging import get_logger
from pdmesh_service.tasks import pause, stop_with

__all__ = [
    "InstanceInfo",
    "Load",
    "Registry",
    "Role",
    "connect",
    "heartbeat_forever",
    "instance_key",
    "namespace",
    "stay_registered",
]
log = get_logger(__name__)
TTL_BEATS = 5  # registry entries live this many heartbeat intervals


def namespace(deployment: str) -> str:
    return f"pdmesh:{deployment}"


def instance_key(deployment: str, instance_id: str) -> str:
    """The registry key of one instance rank (what a synchronous reader GETs)."""
    return f"{namespace(deployment)}:instance:{instance_id}"


class Registry:
    def __init__(self, client: aioredis.Redis, deployment: str = "default") -> None:
        self.client, self.prefix, self.deployment = client, namespace(deployment), deployment

    def key(self, instance_id: str) -> str:
        return instance_key(self.deployment, instance_id)

    async def publish(self, info: InstanceInfo, ttl_s: float) -> bool:
        """Write the entry; whether it was missing before (first publish, or lost meanwhile)."""
        stamped = replace(info, updated_ms=int(time.time() * 1000))
        previous = await self.client.set(
            self.key(info.instance_id), stamped.to_json(), px=int(ttl_s * 1000), get=True
        )
        return previous is None

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
    ttl_s: float = TTL_BEATS * 1.0,
    on_missing: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Publish `report()` every interval until cancelled; Redis hiccups are logged, not fatal. When
    the entry was missing (Redis lost it), `on_missing()` re-publishes what goes with it."""
    while True:
        try:
            if await registry.publish(await _reported(report), ttl_s) and on_missing is not None:
                log.warning("registry entry was missing (Redis restarted?); re-publishing")
                await on_missing()
        except (aioredis.RedisError, OSError) as e:
            log.warning("heartbeat failed", error=str(e))
        except MeshError as e:  # on_missing's peer (the kvstore) is down: next beat tries again
            log.warning("re-publishing after a lost registry entry failed", error=str(e))
            with contextlib.suppress(aioredis.RedisError, OSError):
                await registry.remove((await _reported(report)).instance_id)
        await pause(interval_s)


async def stay_registered(
    stack: contextlib.AsyncExitStack,
    registry: Registry,
    report: Callable[[], Awaitable[InstanceInfo] | InstanceInfo],
    heartbeat_s: float,
    on_missing: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Heartbeat `report()` (TTL: `TTL_BEATS` beats) until `stack` closes, which stops the beat and
    removes the entry; `on_missing` as in `heartbeat_forever`."""
    info = await _reported(report)
    ttl_s = TTL_BEATS * heartbeat_s
    stack.push_async_callback(_remove_quietly, registry, info.instance_id)
    try:
        await registry.publish(info, ttl_s)
    except (aioredis.RedisError, OSError) as e:  # Redis restarting: the heartbeat publishes later
        log.warning("first registry publish failed; the heartbeat retries", error=str(e))
    stop_with(stack, heartbeat_forever(registry, report, heartbeat_s, ttl_s, on_missing))


async def _remove_quietly(registry: Registry, instance_id: str) -> None:
    """Leave the registry; with Redis down the entry expires by itself."""
    try:
        await registry.remove(instance_id)
    except (aioredis.RedisError, OSError) as e:
        log.warning("could not leave the registry (its entry will expire)", error=str(e))


def connect(url: str) -> aioredis.Redis:
    """The services' Redis client (`redis_client.connect`: plain or Sentinel URLs)."""
    return redis_client.connect(url, decode_responses=False)
