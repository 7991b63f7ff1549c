"""The gateway's autoscale loop (`pdmesh serve gateway --autoscale prefill=1..3,decode=1..2`): every
`--autoscale-interval-s` it samples the pools, asks the planner, and publishes the desired counts.

Chain: the orchestrator (its load window, prefill admission, requests waiting for decode blocks) and
the router (ready ranks, their KV blocks) → `pool_load` → `LoadWindow.sample` / `snapshot` →
`autoscale.Autoscaler.plan` → a `Decision` per pool → Redis (`pdmesh_service.scaling`, read by
`pdmesh up`), the `pdmesh_autoscale_*` gauges on /metrics (read by KEDA), and one structlog line
per change with its reason. Redis down: the tick goes on (gauges and decisions), the publish is
retried at the next one.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from pdmesh_gateway.autoscale import (
    ARRIVAL_RATE_METRIC,
    DESIRED_REPLICAS_METRIC,
    KV_WAITING_METRIC,
    QUEUE_TIME_METRIC,
    READY_REPLICAS_METRIC,
    UTILIZATION_METRIC,
    Autoscaler,
    AutoscaleSettings,
    Decision,
    Signals,
)
from pdmesh_gateway.orchestrator import Mode, Orchestrator
from pdmesh_gateway.router import Router
from pdmesh_service.instance import Role
from pdmesh_service.logging import get_logger
from pdmesh_service.scaling import (
    DesiredReplicas,
    PoolBounds,
    format_bounds,
    parse_bounds,
    publish_desired,
)
from pdmesh_service.tasks import pause

log = get_logger(__name__)
TTL_TICKS, MIN_TTL_S = 10, 10.0  # the published counts outlive this many ticks (at least MIN_TTL_S)


@dataclass(frozen=True)
class AutoscaleConfig:
    """`--autoscale` (the pools and their bounds) and its settings flags."""

    bounds: Mapping[str, PoolBounds]
    settings: AutoscaleSettings = field(default_factory=AutoscaleSettings)

    def __str__(self) -> str:
        return format_bounds(self.bounds)


def _bounds(text: str) -> dict[str, PoolBounds]:
    try:
        return parse_bounds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_autoscale_arguments(p: argparse.ArgumentParser) -> None:
    d = AutoscaleSettings()
    g = p.add_argument_group("autoscaling (the desired prefill and decode replicas)")
    g.add_argument(
        "--autoscale",
        type=_bounds,
        default=None,
        metavar="POOL=MIN..MAX,...",
        help="decide the replicas of these pools (prefill, decode) from the load, publish them in "
        "Redis (`pdmesh up` acts on them) and as pdmesh_autoscale_desired_replicas{pool} (KEDA); "
        "default: off",
    )
    for flag, default, what in (
        ("--autoscale-interval-s", d.interval_s, "seconds between two decisions"),
        ("--autoscale-window-s", d.window_s, "seconds of recent load each decision reads"),
        ("--autoscale-target-queue-s", d.target_queue_s, "grow above this queue time (p90)"),
        ("--autoscale-target-utilization", d.target_utilization, "grow above this utilisation"),
        (
            "--autoscale-low-utilization",
            d.low_utilization,
            "shrink only while the utilisation with one replica fewer stays below this (and the "
            "queue time is ~0)",
        ),
        ("--autoscale-cooldown-s", d.cooldown_s, "the low load must last this long to shrink"),
        (
            "--autoscale-up-cooldown-s",
            None,
            "seconds after a pool's last step was served before it grows again",
        ),
        (
            "--autoscale-up-stable-s",
            d.up_stable_s,
            "grow only once the pool was the bottleneck this long without a break",
        ),
    ):
        shown = "the window" if default is None else default
        g.add_argument(flag, type=float, default=default, help=f"{what} (default: {shown})")


def autoscale_from_args(args: argparse.Namespace) -> AutoscaleConfig | None:
    """The validated config (ValueError), None without --autoscale."""
    if args.autoscale is None:
        return None
    settings = AutoscaleSettings(
        interval_s=args.autoscale_interval_s,
        window_s=args.autoscale_window_s,
        target_queue_s=args.autoscale_target_queue_s,
        target_utilization=args.autoscale_target_utilization,
        low_utilization=args.autoscale_low_utilization,
        cooldown_s=args.autoscale_cooldown_s,
        up_cooldown_s=args.autoscale_up_cooldown_s,
        up_stable_s=args.autoscale_up_stable_s,
    )
    return AutoscaleConfig(args.autoscale, settings)


@dataclass(frozen=True)
class PoolLoad:
    """The pools' state now: prefill slots in use / slots, decode KV blocks in use / blocks (mean
    over the ready ranks), requests waiting for decode KV blocks at the gateway."""

    prefill_utilization: float
    decode_utilization: float
    kv_waiting: int


def pool_load(orchestrator: Orchestrator, router: Router) -> PoolLoad:
    admission = orchestrator.admission
    prefills = router.ready(Role.PREFILL)
    slots = len(prefills) * admission.limit
    in_flight = sum(admission.in_flight(i.instance_id) for i in prefills)
    fractions = [
        i.stats.num_kv_blocks_used / total
        for i in router.ready(Role.DECODE)
        if (total := i.stats.num_kv_blocks_used + i.stats.num_kv_blocks_free) > 0
    ]
    return PoolLoad(
        in_flight / slots if slots else 0.0,
        sum(fractions) / len(fractions) if fractions else 0.0,
        orchestrator.starter.blocks_waiting,
    )


class AutoscaleMetrics:
    """The planner's inputs and outputs as Prometheus series."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.desired = Gauge(
            DESIRED_REPLICAS_METRIC, "Replicas the autoscaler wants", ["pool"], registry=registry
        )
        self.ready = Gauge(
            READY_REPLICAS_METRIC, "Replicas ready (routable) now", ["pool"], registry=registry
        )
        self.utilization = Gauge(
            UTILIZATION_METRIC,
            "Pool utilisation over the window (prefill: slots in use; decode: KV blocks in use)",
            ["pool"],
            registry=registry,
        )
        self.queue_time = Gauge(
            QUEUE_TIME_METRIC,
            "Queue time at the gateway over the window (p90, or the oldest wait now)",
            registry=registry,
        )
        self.arrival_rate = Gauge(
            ARRIVAL_RATE_METRIC, "Requests arriving per second over the window", registry=registry
        )
        self.kv_waiting = Gauge(
            KV_WAITING_METRIC, "Requests waiting for decode KV blocks (mean)", registry=registry
        )
        self.changes = Counter(
            "pdmesh_autoscale_changes",
            "Changes of a pool's desired replicas",
            ["pool", "direction"],
            registry=registry,
        )

    def observe(self, signals: Signals, decisions: Mapping[str, Decision]) -> None:
        self.queue_time.set(signals.queue_time_s)
        self.arrival_rate.set(signals.arrival_rate)
        self.kv_waiting.set(signals.kv_waiting)
        for pool, decision in decisions.items():
            self.desired.labels(pool).set(decision.replicas)
            self.ready.labels(pool).set(signals.pool(pool).ready)
            self.utilization.labels(pool).set(signals.pool(pool).utilization)
            if decision.is_change:
                up = decision.replicas > decision.previous
                self.changes.labels(pool, "up" if up else "down").inc()


class AutoscaleLoop:
    """The loop (module docstring); `tick(now)` is one turn without the publish."""

    def __init__(
        self,
        config: AutoscaleConfig,
        orchestrator: Orchestrator,
        router: Router,
        redis: aioredis.Redis,
        deployment: str,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        """`registry`: where the gauges go (the process's, which /metrics exposes)."""
        self.config, self.orchestrator, self.router = config, orchestrator, router
        self.redis, self.deployment = redis, deployment
        # agg mode: decode ranks compute the prompts, the queue time is theirs
        has_prefill_pool = orchestrator.mode is Mode.DISAGG
        self.planner = Autoscaler(config.bounds, config.settings, has_prefill_pool=has_prefill_pool)
        self.metrics = AutoscaleMetrics(registry)
        self.desired: dict[str, DesiredReplicas] = {}
        self._publish_failed = False

    def tick(self, now: float) -> dict[str, Decision]:
        window = self.orchestrator.load_window
        load = pool_load(self.orchestrator, self.router)
        window.sample(now, load.prefill_utilization, load.decode_utilization, load.kv_waiting)
        signals = window.snapshot(
            now, len(self.router.ready(Role.PREFILL)), len(self.router.ready(Role.DECODE))
        )
        decisions = self.planner.plan(signals, now)
        self.metrics.observe(signals, decisions)
        at_ms = int(time.time() * 1000)
        for pool, decision in decisions.items():
            if decision.is_change or pool not in self.desired:
                self.desired[pool] = DesiredReplicas(decision.replicas, decision.reason, at_ms)
            if decision.is_change:
                log.info(
                    "autoscale: desired replicas changed",
                    pool=pool,
                    previous=decision.previous,
                    replicas=decision.replicas,
                    signal=str(decision.signal),
                    reason=decision.reason,
                    queue_time_s=round(signals.queue_time_s, 3),
                    arrival_rate=round(signals.arrival_rate, 3),
                    utilization=round(signals.pool(pool).utilization, 3),
                    ready=signals.pool(pool).ready,
                )
        return decisions

    async def publish(self) -> None:
        """The desired counts to Redis; a failure is logged once and retried at the next tick."""
        ttl_s = max(TTL_TICKS * self.config.settings.interval_s, MIN_TTL_S)
        try:
            await publish_desired(self.redis, self.deployment, self.desired, ttl_s)
            self._publish_failed = False
        except (aioredis.RedisError, OSError) as e:
            if not self._publish_failed:
                log.warning("autoscale: publishing the desired replicas failed", error=str(e))
            self._publish_failed = True

    async def run(self) -> None:
        """Forever: tick, publish, pause."""
        log.info("autoscale: on", pools=str(self.config), settings=str(self.config.settings))
        while True:
            self.tick(time.monotonic())  # the load window's clock
            await self.publish()
            await pause(self.config.settings.interval_s)
