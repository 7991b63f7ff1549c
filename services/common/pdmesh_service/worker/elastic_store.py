"""The group records of an elastic DEP instance in the deployment's Redis (a `CoordStore`,
pdmesh_engine.parallel.membership): no rank hosts them, so losing any rank loses none.

Keys: `pdmesh:{deployment}:dep:{instance}:{run_id}:<key>` (string values, expiring after
`RECORD_TTL_S`; a run's records are refreshed at every re-form). `run_id` is the supervisor's,
so a restarted instance never reads an older run's epochs. Called from the engine thread only
(a synchronous client: the re-form blocks the step anyway).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdmesh_engine.parallel.membership import MembershipStore
from pdmesh_service.redis_client import connect_sync
from pdmesh_service.registry import namespace

if TYPE_CHECKING:
    import redis

RECORD_TTL_S = 7 * 24 * 3600


def group_prefix(deployment: str, instance: str, run_id: str) -> str:
    return f"{namespace(deployment)}:dep:{instance}:{run_id}:"


class RedisCoordStore:
    """`CoordStore` on a synchronous Redis client."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def put(self, key: str, value: str, exclusive: bool = False) -> bool:
        return bool(self.client.set(key, value, nx=exclusive, ex=RECORD_TTL_S))

    def get(self, key: str) -> str | None:
        value = self.client.get(key)
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)

    def keys(self, prefix: str) -> list[str]:
        pattern = prefix.replace("[", "\\[").replace("*", "\\*").replace("?", "\\?") + "*"
        return [
            k.decode() if isinstance(k, bytes) else str(k)
            for k in self.client.scan_iter(match=pattern, count=500)
        ]


def membership_store(
    redis_url: str, deployment: str, instance: str, run_id: str
) -> MembershipStore:
    """The membership records of one run of an elastic DEP instance."""
    client = connect_sync(redis_url, socket_timeout=5.0)
    return MembershipStore(RedisCoordStore(client), group_prefix(deployment, instance, run_id))
