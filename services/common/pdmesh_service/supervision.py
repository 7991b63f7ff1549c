"""Supervised restarts: the policy that decides when a dead process comes back, and the restart
records a mesh keeps in Redis for `/mesh`.

exit of a service → `RestartTracker.on_exit(now, healthy_since)` → a delay (restart then, same argv)
or None (the restart budget is spent: give up on the mesh). The tracker is pure (times are passed
in), so the launcher's loop stays thin and the policy is tested without processes.

Records: hash `pdmesh:{deployment}:restarts`, field = service name (an instance id, or `redis`) →
JSON `{"restarts": int, "last_exit_code": int, "at_ms": int}` (`at_ms`: wall-clock ms of the last
restart). Written by the launcher once Redis answers again (the embedded Redis may be what
restarted, losing the hash: the launcher writes every record again), read by the gateway's `/mesh`.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis
    import redis.asyncio as aioredis


@dataclass(frozen=True)
class RestartPolicy:
    """How a dead service is restarted: after `backoff_s`, doubling per consecutive failure up to
    `max_backoff_s`; the streak resets once the service ran `healthy_s` (SERVING) before dying.
    At most `max_restarts` restarts per service within `window_s`: the next exit gives up (0: the
    first exit gives up, i.e. no supervision)."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    healthy_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"need 0 < backoff ({self.backoff_s}) <= max backoff ({self.max_backoff_s})"
            )
        if self.window_s <= 0 or self.healthy_s <= 0:
            raise ValueError(
                f"the restart window ({self.window_s}) and the healthy run ({self.healthy_s}) "
                "must be positive"
            )

    def backoff(self, streak: int) -> float:
        """The delay before the restart that follows `streak` consecutive failed runs."""
        return min(self.backoff_s * 2.0**streak, self.max_backoff_s)


@dataclass
class RestartTracker:
    """One service's restart history under a `RestartPolicy`. `restarts` counts every restart
    decided so far (never reset)."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    restarts: int = 0
    _streak: int = 0
    _times: deque[float] = field(default_factory=deque)  # restarts within the window, oldest first

    def on_exit(self, now: float, healthy_since: float | None) -> float | None:
        """The service died at `now` (monotonic seconds), SERVING since `healthy_since` (None: it
        never got there in this run): seconds to wait before restarting it, or None to give up."""
        if healthy_since is not None and now - healthy_since >= self.policy.healthy_s:
            self._streak = 0
        while self._times and self._times[0] <= now - self.policy.window_s:
            self._times.popleft()
        if len(self._times) >= self.policy.max_restarts:
            return None
        delay = self.policy.backoff(self._streak)
        self._streak += 1
        self._times.append(now)
        self.restarts += 1
        return delay


@dataclass(frozen=True)
class RestartRecord:
    """What `/mesh` shows of one service's restarts."""

    restarts: int
    last_exit_code: int
    at_ms: int

    def to_json(self) -> str:
        return json.dumps(
            {"restarts": self.restarts, "last_exit_code": self.last_exit_code, "at_ms": self.at_ms}
        )


def restarts_key(deployment: str) -> str:
    return f"pdmesh:{deployment}:restarts"


def _decode(raw: dict[Any, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, value in raw.items():
        key = name.decode() if isinstance(name, bytes) else str(name)
        out[key] = json.loads(value)
    return out


async def record_restart(
    redis: aioredis.Redis,
    deployment: str,
    name: str,
    restarts: int,
    last_exit_code: int,
    at_ms: int,
) -> None:
    """Store (replace) the restart record of service `name`."""
    record = RestartRecord(restarts, last_exit_code, at_ms)
    await redis.hset(restarts_key(deployment), name, record.to_json())


async def read_restarts(redis: aioredis.Redis, deployment: str) -> dict[str, dict[str, Any]]:
    """Every restart record of the deployment: name → {"restarts", "last_exit_code", "at_ms"}
    (empty when nothing restarted)."""
    raw = await redis.hgetall(restarts_key(deployment))
    return _decode(raw)


def record_restarts_sync(
    redis: redis.Redis, deployment: str, records: dict[str, RestartRecord]
) -> None:
    """Store every record in one round trip (the launcher's synchronous client)."""
    if records:
        redis.hset(
            restarts_key(deployment),
            mapping={name: record.to_json() for name, record in records.items()},
        )


def read_restarts_sync(redis: redis.Redis, deployment: str) -> dict[str, dict[str, Any]]:
    """`read_restarts` with a synchronous client."""
    raw: dict[Any, Any] = redis.hgetall(restarts_key(deployment))
    return _decode(raw)
