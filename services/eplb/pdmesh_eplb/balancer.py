"""The controller's loop: Redis (eplb_protocol) in and out around the pure `controller.decide`.

    every poll: tracked (instance, model) → read reports + placement → decide("interval")
      → compare-and-set version V + its history record (one Lua script) → metrics

Holds no state that correctness needs: versions, history and the Off switches live in Redis, so a
restarted controller continues at V + 1. Rebalances of one process run one at a time (a lock); two
processes cannot fork a version (the compare-and-set). Planning runs in a thread: the RPCs stay
served.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from pdmesh_eplb.controller import ModelView, Policy, Skip, decide
from pdmesh_eplb.metrics import EplbMetrics
from pdmesh_service import eplb_protocol as proto
from pdmesh_service.eplb_protocol import EplbSummary, Placement, RebalanceReason, RebalanceRecord
from pdmesh_service.logging import get_logger
from pdmesh_service.tasks import pause

log = get_logger(__name__)


class Balancer:
    def __init__(
        self,
        redis: aioredis.Redis,
        deployment: str,
        policy: Policy,
        metrics: EplbMetrics,
        *,
        default_enabled: bool = True,
        clock_ms: Callable[[], int] | None = None,
    ) -> None:
        self.redis, self.deployment, self.policy, self.metrics = redis, deployment, policy, metrics
        self.default_enabled = default_enabled
        self.clock_ms = clock_ms or (lambda: int(time.time() * 1000))
        self._lock = asyncio.Lock()

    async def view(self, instance: str, model: str) -> ModelView:
        reports = await proto.read_loads(self.redis, self.deployment, instance, model)
        placement = await proto.read_placement(self.redis, self.deployment, instance, model)
        return ModelView(instance, model, tuple(reports), placement)

    async def is_enabled(self, instance: str) -> bool:
        return bool(
            await proto.is_enabled(self.redis, self.deployment, instance, self.default_enabled)
        )

    async def set_enabled(self, instance: str, on: bool) -> None:
        await proto.set_enabled(self.redis, self.deployment, instance, on)

    async def rebalance(
        self, instance: str, model: str, reason: RebalanceReason, force: bool = False
    ) -> RebalanceRecord | Skip:
        """Plan and publish the next version of (instance, model), or say why not."""
        async with self._lock:
            view = await self.view(instance, model)
            is_enabled = await self.is_enabled(instance) if reason == "interval" else True
            started = time.perf_counter()
            decision = await asyncio.to_thread(
                decide, view, self.policy, reason, is_enabled=is_enabled, force=force
            )
            plan_ms = (time.perf_counter() - started) * 1000.0
            if isinstance(decision, Skip):
                return decision
            now_ms = self.clock_ms()
            record = decision.record(now_ms, plan_ms)
            if not await proto.write_placement(
                self.redis, self.deployment, decision.placement(now_ms), view.version, record
            ):
                return Skip(
                    f"version {decision.version} was published by another controller meanwhile"
                )
        self.metrics.published(record)
        self.metrics.observe(instance, model, record.version, None)
        log.info(
            "placement published",
            instance=instance,
            model=model,
            version=record.version,
            reason=reason,
            slots_moved=record.num_slots_moved,
            before=record.balancedness_before,
            after=record.balancedness_after,
            plan_ms=record.plan_ms,
        )
        return record

    async def poll_once(self) -> dict[tuple[str, str], RebalanceRecord | Skip]:
        """One periodic pass over every tracked (instance, model); what happened to each. A
        malformed report of one pair (a rank of another release) skips that pair, not the pass."""
        outcomes: dict[tuple[str, str], RebalanceRecord | Skip] = {}
        for instance, model in await proto.tracked(self.redis, self.deployment):
            try:
                outcomes[(instance, model)] = await self.rebalance(instance, model, "interval")
            except (ValueError, TypeError, KeyError) as e:
                outcomes[(instance, model)] = Skip(f"unreadable state in Redis: {e!r}")
                log.warning("eplb state unreadable", instance=instance, model=model, error=repr(e))
        return outcomes

    async def run(self, poll_s: float) -> None:
        """`poll_once` every `poll_s` until cancelled; Redis hiccups and unreadable records are
        logged, not fatal (the loop must outlive them: it is the controller)."""
        while True:
            try:
                await self.poll_once()
                await self.status()  # refreshes the gauges
            except (aioredis.RedisError, OSError, ValueError, TypeError, KeyError) as e:
                log.warning("eplb poll failed", error=repr(e))
            await pause(poll_s)

    async def status(self) -> list[EplbSummary]:
        """Every tracked (instance, model), sorted; refreshes the balancedness and version
        gauges."""
        found = await proto.summarize_all(self.redis, self.deployment, self.default_enabled)
        for s in found:
            self.metrics.observe(s.instance, s.model, s.version, s.balancedness)
        return found

    async def placement(
        self, instance: str, model: str, version: int = 0
    ) -> tuple[Placement | None, list[RebalanceRecord]]:
        """Version `version` (0: the current one; the identity layout when none was written and the
        ranks report their shape) and the history, newest first. None when unknown."""
        found = await proto.read_placement(
            self.redis, self.deployment, instance, model, None if version == 0 else version
        )
        if found is None and version == 0:
            reports = await proto.read_loads(self.redis, self.deployment, instance, model)
            if reports:
                r = reports[0]
                found = proto.identity_placement(
                    instance, model, r.dp_size, r.num_layers, r.num_slots, r.num_logical
                )
        return found, await proto.read_history(self.redis, self.deployment, instance, model)
