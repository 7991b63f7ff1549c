"""Which worker rank gets a request (pure policy), and the loop that keeps the view fresh.

Policy: only `ready` instances are routable.
- decode: fewest requests, counted as the rank's last heartbeat (`Load.num_running + num_waiting`)
  plus the requests this gateway sent it since that heartbeat (heartbeats lag; without this, a burst
  would all go to the same idle rank).
- prefill: fewest requests this gateway has in flight on it. (The orchestrator admits requests to
  prefill ranks through `admission.PrefillAdmission`, the same policy with a per-rank cap and a
  queue.)
Ties are broken in turn: the first tied instance (by id) after the one picked last time for that
role, so equal ranks take requests round robin. No candidate → `NoInstance` (503).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable

from pdmesh_service.errors import Unavailable
from pdmesh_service.instance import InstanceInfo, Role
from pdmesh_service.logging import get_logger

log = get_logger(__name__)


class NoInstance(Unavailable):
    """No ready instance of the needed role (not worth retrying at once)."""


def _now_ms() -> int:
    return int(time.time() * 1000)


class Router:
    def __init__(self) -> None:
        self._instances: list[InstanceInfo] = []
        self._sent: dict[str, list[int]] = {}  # decode id -> send times (ms) since its heartbeat
        self._prefill_in_flight: dict[str, int] = {}
        self._last: dict[Role, str] = {}  # role -> id picked last

    def update(self, instances: Iterable[InstanceInfo]) -> None:
        """Replace the view with the registry's; forget sends that the new heartbeats include."""
        self._instances = sorted(instances, key=lambda i: i.instance_id)
        stamps = {i.instance_id: i.updated_ms for i in self._instances}
        self._sent = {
            k: [t for t in v if t > stamps[k]] for k, v in self._sent.items() if k in stamps
        }

    def snapshot(self) -> list[InstanceInfo]:
        return list(self._instances)

    def ready(self, role: Role) -> list[InstanceInfo]:
        return [i for i in self._instances if i.role == role and i.ready]

    def has_ready(self, role: Role) -> bool:
        return any(i.role == role and i.ready for i in self._instances)

    def decode_load(self, info: InstanceInfo) -> int:
        load = info.stats
        return load.num_running + load.num_waiting + len(self._sent.get(info.instance_id, ()))

    def prefill_load(self, info: InstanceInfo) -> int:
        return self._prefill_in_flight.get(info.instance_id, 0)

    def pick_decode(self, exclude: Iterable[str] = ()) -> InstanceInfo:
        return self._pick(Role.DECODE, self.decode_load, exclude)

    def pick_prefill(self, exclude: Iterable[str] = ()) -> InstanceInfo:
        return self._pick(Role.PREFILL, self.prefill_load, exclude)

    def _pick(
        self, role: Role, load: Callable[[InstanceInfo], int], exclude: Iterable[str]
    ) -> InstanceInfo:
        excluded = set(exclude)
        candidates = [i for i in self.ready(role) if i.instance_id not in excluded]
        if not candidates:
            raise NoInstance(f"no ready {role} instance" + (" left to try" if excluded else ""))
        best = min(load(i) for i in candidates)
        tied = [i for i in candidates if load(i) == best]
        last = self._last.get(role, "")
        choice = next((i for i in tied if i.instance_id > last), tied[0])
        self._last[role] = choice.instance_id
        return choice

    def note_sent(self, instance_id: str, now_ms: int | None = None) -> None:
        """A request went to this decode rank (counted until a later heartbeat)."""
        self._sent.setdefault(instance_id, []).append(_now_ms() if now_ms is None else now_ms)

    def prefill_started(self, instance_id: str) -> None:
        self._prefill_in_flight[instance_id] = self._prefill_in_flight.get(instance_id, 0) + 1

    def prefill_finished(self, instance_id: str) -> None:
        left = self._prefill_in_flight.get(instance_id, 0) - 1
        if left > 0:
            self._prefill_in_flight[instance_id] = left
        else:
            self._prefill_in_flight.pop(instance_id, None)


async def refresh_forever(
    router: Router, fetch: Callable[[], Awaitable[list[InstanceInfo]]], interval_s: float = 0.5
) -> None:
    """Feed `fetch()` (the registry's instances) to the router every interval; errors keep the old
    view."""
    while True:
        try:
            router.update(await fetch())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - Redis down: keep routing on the last view
            log.warning("registry refresh failed", error=f"{type(e).__name__}: {e}")
        await asyncio.sleep(interval_s)
