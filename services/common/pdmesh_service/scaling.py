"""Autoscaling's shared vocabulary: the pools, their bounds and the desired replica counts the
gateway publishes for whoever starts and stops workers (`pdmesh up`).

Chain: `--autoscale prefill=1..3,decode=1..2` → `parse_bounds` → {pool: PoolBounds} (the gateway's
planner and the launcher read the same text) → the gateway's loop decides → `publish_desired` →
Redis → `read_desired_sync` (the launcher) → workers started or drained.

Key: hash `pdmesh:{deployment}:autoscale`, field = pool ("prefill", "decode") → JSON
`{"replicas": int, "reason": str, "at_ms": int}` (`at_ms`: wall-clock ms of the last change of
that pool). Written by the gateway at every tick with a TTL, so a gateway that stopped steering
leaves no stale wish behind once it expires (the launcher then keeps the counts it has).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis
    import redis.asyncio as aioredis

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class PoolBounds:
    """The replicas a pool may have: `min_replicas` (what the mesh starts with) to
    `max_replicas`, both at least 1."""

    min_replicas: int
    max_replicas: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"autoscale bounds need 1 <= min <= max, got {self.min_replicas}.."
                f"{self.max_replicas}"
            )

    def clamp(self, replicas: int) -> int:
        return min(max(replicas, self.min_replicas), self.max_replicas)

    def __str__(self) -> str:
        return f"{self.min_replicas}..{self.max_replicas}"


def parse_bounds(text: str) -> dict[str, PoolBounds]:
    """`prefill=1..3,decode=1..2` → {"prefill": PoolBounds(1, 3), "decode": PoolBounds(1, 2)};
    ValueError naming what is wrong (an unknown pool, a pool twice, bad numbers)."""
    bounds: dict[str, PoolBounds] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        pool, sep, span = item.partition("=")
        pool = pool.strip()
        low, dots, high = span.strip().partition("..")
        if not sep or not dots or not low.strip().isdigit() or not high.strip().isdigit():
            raise ValueError(f"expected POOL=MIN..MAX (e.g. prefill=1..3), got {item!r}")
        if pool not in POOLS:
            raise ValueError(f"unknown pool {pool!r} in --autoscale (pools: {', '.join(POOLS)})")
        if pool in bounds:
            raise ValueError(f"pool {pool!r} given twice in --autoscale")
        bounds[pool] = PoolBounds(int(low), int(high))
    if not bounds:
        raise ValueError("--autoscale names no pool (e.g. prefill=1..3,decode=1..2)")
    return bounds


def format_bounds(bounds: Mapping[str, PoolBounds]) -> str:
    """The flag text of `bounds` (`parse_bounds`' inverse), pools in POOLS order."""
    return ",".join(f"{pool}={bounds[pool]}" for pool in POOLS if pool in bounds)


@dataclass(frozen=True)
class DesiredReplicas:
    """What the gateway wants of one pool: `replicas`, why (`reason`), since when (`at_ms`)."""

    replicas: int
    reason: str = ""
    at_ms: int = 0

    def to_json(self) -> str:
        return json.dumps({"replicas": self.replicas, "reason": self.reason, "at_ms": self.at_ms})

    @classmethod
    def from_json(cls, raw: str | bytes) -> DesiredReplicas:
        values = json.loads(raw)
        return cls(int(values["replicas"]), str(values.get("reason", "")), int(values["at_ms"]))


def autoscale_key(deployment: str) -> str:
    return f"pdmesh:{deployment}:autoscale"


async def publish_desired(
    client: aioredis.Redis,
    deployment: str,
    desired: Mapping[str, DesiredReplicas],
    ttl_s: float,
) -> None:
    """Replace the desired counts (one round trip), alive for `ttl_s`."""
    key = autoscale_key(deployment)
    async with client.pipeline(transaction=True) as pipe:
        pipe.delete(key)
        pipe.hset(key, mapping={pool: d.to_json() for pool, d in desired.items()})
        pipe.pexpire(key, int(ttl_s * 1000))
        await pipe.execute()


def _decode(raw: Mapping[Any, Any]) -> dict[str, DesiredReplicas]:
    out: dict[str, DesiredReplicas] = {}
    for name, value in raw.items():
        pool = name.decode() if isinstance(name, bytes) else str(name)
        if pool in POOLS:
            out[pool] = DesiredReplicas.from_json(value)
    return out


async def read_desired(client: aioredis.Redis, deployment: str) -> dict[str, DesiredReplicas]:
    """The desired counts now: pool → DesiredReplicas ({} when none is published)."""
    return _decode(await client.hgetall(autoscale_key(deployment)))


def read_desired_sync(client: redis.Redis, deployment: str) -> dict[str, DesiredReplicas]:
    """`read_desired` with a synchronous client (the launcher)."""
    raw: Mapping[Any, Any] = client.hgetall(autoscale_key(deployment))
    return _decode(raw)
