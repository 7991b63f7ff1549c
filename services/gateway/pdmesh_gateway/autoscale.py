"""How many prefill and decode replicas the mesh should run (pure: no asyncio, grpc, redis or
clock; the caller passes `now`).

Chain: the gateway's state, sampled each tick → `load_window.LoadWindow` → `Signals` (the recent
window) → `Autoscaler.plan(signals, now)` → a `Decision` per pool (desired replicas, and the signal
that bound them) → `autoscale_loop` publishes it (Redis for `pdmesh up`, a Prometheus gauge for
KEDA).

Rules, per pool and tick (n: the pool's desired count, starting at its ready count clamped to the
bounds):
- up to n + 1 when the pool is the bottleneck. prefill: the queue time (how long requests waited at
  the gateway for a prefill slot: the window's p90, or the oldest wait now if longer) is above
  `target_queue_s`, unless requests wait for decode KV blocks (then the queue is decode's), or its
  utilisation (prefill slots in use / slots, window mean) is above `target_utilization`. decode:
  requests wait for KV blocks (window mean >= `kv_waiting_up`), or its KV utilisation is above
  `target_utilization`, or (agg mode: no prefill pool) the queue time is above its target. Only once
  that held for `up_stable_s` without a break (a transient spike scales nothing), the previous step
  is served (ready >= n), and `up_cooldown_s` passed since it was (the window then shows the new
  size, not the start of the new replica).
- down to n - 1 when the utilisation with one replica fewer (mean x ready / (ready - 1)) is below
  `low_utilization`, the queue time is ~0 (<= `idle_queue_s`) and nothing waits for decode KV, all
  of it continuously for `cooldown_s` since the pool's last change.
- never outside the pool's bounds.
Hysteresis: up past the targets, down only below `low_utilization` < `target_utilization` (with one
replica fewer) and a queue time of ~0, held a whole cooldown; a signal swinging inside the band
changes nothing, and two changes of a pool are at least min(up_cooldown_s, cooldown_s) apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from pdmesh_service.scaling import POOLS, PoolBounds

# the gateway's series (autoscale_loop exports them; the k8s ScaledObjects query the first)
DESIRED_REPLICAS_METRIC = "pdmesh_autoscale_desired_replicas"
READY_REPLICAS_METRIC = "pdmesh_autoscale_ready_replicas"
QUEUE_TIME_METRIC = "pdmesh_autoscale_queue_time_seconds"
ARRIVAL_RATE_METRIC = "pdmesh_autoscale_arrival_rate"
UTILIZATION_METRIC = "pdmesh_autoscale_utilization"
KV_WAITING_METRIC = "pdmesh_autoscale_kv_waiting_requests"


class Signal(StrEnum):
    """What bound a decision."""

    QUEUE_TIME = "queue_time"  # up: requests wait too long at the gateway
    UTILIZATION = "utilization"  # up: the pool is busier than its target
    KV_WAITING = "kv_waiting"  # up: requests wait for decode KV blocks
    LOW_LOAD = "low_load"  # down, or holding while the low load has not lasted a cooldown
    BOUNDS = "bounds"  # hold: the step would leave the bounds
    STARTING = "starting"  # hold: the previous step's replicas are not all ready (or gone) yet
    COOLDOWN = "cooldown"  # hold: too soon after the pool's last change
    STEADY = "steady"  # hold: inside the hysteresis band

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class AutoscaleSettings:
    """The planner's knobs (module docstring); `interval_s` is the loop's period."""

    interval_s: float = 1.0
    window_s: float = 10.0  # signals are averaged over this much recent time
    target_queue_s: float = 0.5
    target_utilization: float = 0.8
    low_utilization: float = 0.3
    cooldown_s: float = 60.0
    up_cooldown_s: float | None = None  # None: window_s
    up_stable_s: float = 2.0  # the up condition must hold this long before a step up
    kv_waiting_up: float = 1.0  # mean requests waiting for decode KV that make decode grow
    idle_queue_fraction: float = 0.1  # queue time <= this x target_queue_s counts as ~0

    def __post_init__(self) -> None:
        for name in ("interval_s", "window_s", "target_queue_s", "kv_waiting_up"):
            if not getattr(self, name) > 0:
                raise ValueError(f"autoscale {name} must be positive, got {getattr(self, name)}")
        if not 0 < self.low_utilization < self.target_utilization <= 1:
            raise ValueError(
                "autoscale utilisations need 0 < low < target <= 1, got low "
                f"{self.low_utilization}, target {self.target_utilization}"
            )
        if min(self.cooldown_s, self.up_stable_s) < 0 or (
            self.up_cooldown_s is not None and self.up_cooldown_s < 0
        ):
            raise ValueError("autoscale cooldowns must be >= 0")
        if not 0 <= self.idle_queue_fraction < 1:
            raise ValueError(
                f"idle_queue_fraction must be in [0, 1), got {self.idle_queue_fraction}"
            )

    @property
    def idle_queue_s(self) -> float:
        return self.target_queue_s * self.idle_queue_fraction

    @property
    def up_delay_s(self) -> float:
        return self.window_s if self.up_cooldown_s is None else self.up_cooldown_s


@dataclass(frozen=True)
class PoolSignals:
    """One pool over the window: `ready` replicas now, `utilization` (window mean, 0..1)."""

    ready: int = 0
    utilization: float = 0.0


@dataclass(frozen=True)
class Signals:
    """The gateway's view of the recent window (`load_window.LoadWindow.snapshot`)."""

    queue_time_s: float = 0.0  # p90 of the waits for a prefill slot, or the oldest wait now
    kv_waiting: float = 0.0  # mean requests waiting for decode KV blocks
    arrival_rate: float = 0.0  # requests per second
    mean_prompt_tokens: float = 0.0
    mean_output_tokens: float = 0.0
    prefill: PoolSignals = PoolSignals()
    decode: PoolSignals = PoolSignals()

    def pool(self, name: str) -> PoolSignals:
        return self.prefill if name == "prefill" else self.decode


@dataclass(frozen=True)
class Decision:
    """A pool's desired `replicas` (`previous`: before this tick), the signal that bound them and
    why, in words."""

    pool: str
    replicas: int
    previous: int
    signal: Signal
    reason: str

    @property
    def is_change(self) -> bool:
        return self.replicas != self.previous


@dataclass(slots=True)
class _PoolState:
    bounds: PoolBounds
    desired: int | None = None  # None until the first plan
    changed_at: float | None = None
    served_at: float | None = None  # when ready first reached `desired` after the last change
    low_since: float | None = None  # since when the down condition holds without a break
    high_since: float | None = None  # since when the up condition holds without a break


class Autoscaler:
    """Desired replicas of the pools in `bounds` (module docstring). `has_prefill_pool`: False in
    agg mode, where decode ranks compute the prompts and the queue time is decode's."""

    def __init__(
        self,
        bounds: Mapping[str, PoolBounds],
        settings: AutoscaleSettings = AutoscaleSettings(),
        *,
        has_prefill_pool: bool = True,
    ) -> None:
        if not has_prefill_pool and "prefill" in bounds:
            raise ValueError("agg mode has no prefill pool to autoscale: scale decode only")
        unknown = set(bounds) - set(POOLS)
        if unknown:
            raise ValueError(f"unknown pools {sorted(unknown)} (pools: {', '.join(POOLS)})")
        self.settings, self.has_prefill_pool = settings, has_prefill_pool
        self._pools = {pool: _PoolState(bounds[pool]) for pool in POOLS if pool in bounds}

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(self._pools)

    def desired(self, pool: str) -> int | None:
        """The pool's desired count so far (None before the first plan)."""
        return self._pools[pool].desired

    def plan(self, signals: Signals, now: float) -> dict[str, Decision]:
        """Each pool's decision for this tick (the state moves on with it)."""
        return {pool: self._plan_pool(pool, s, signals, now) for pool, s in self._pools.items()}

    def _plan_pool(self, pool: str, state: _PoolState, signals: Signals, now: float) -> Decision:
        ready = signals.pool(pool).ready
        if state.desired is None:
            state.desired = state.bounds.clamp(ready)
        n, bounds = state.desired, state.bounds
        if state.served_at is None and ready >= n:
            state.served_at = now

        def hold(signal: Signal, reason: str) -> Decision:
            return Decision(pool, n, n, signal, reason)

        up = self._up_reason(pool, signals)
        state.high_since = None if up is None else state.high_since
        if up is not None:
            signal, why = up
            state.low_since = None
            state.high_since = now if state.high_since is None else state.high_since
            if n >= bounds.max_replicas:
                return hold(Signal.BOUNDS, f"{why}, but at the maximum ({bounds.max_replicas})")
            if ready < n:
                return hold(Signal.STARTING, f"{why}; {ready} of {n} replicas ready so far")
            lasted = now - state.high_since
            if lasted < self.settings.up_stable_s:
                held = f"{lasted:.0f}s of {self.settings.up_stable_s:g}s"
                return hold(Signal.COOLDOWN, f"{why} for {held}")
            served = state.served_at if state.changed_at is not None else None
            since = None if served is None else now - served
            if since is not None and since < self.settings.up_delay_s:
                wait = f"{since:.0f}s of {self.settings.up_delay_s:g}s"
                return hold(Signal.COOLDOWN, f"{why}; last step served {wait} ago")
            return self._change(state, pool, n + 1, signal, why, now)
        low, why = self._low_reason(pool, signals)
        if not low:
            state.low_since = None
            return hold(Signal.STEADY, why)
        if n <= bounds.min_replicas:
            return hold(Signal.BOUNDS, f"{why}, but at the minimum ({bounds.min_replicas})")
        if ready != n:
            return hold(Signal.STARTING, f"{why}; {ready} replicas ready, {n} desired")
        state.low_since = now if state.low_since is None else state.low_since
        lasted, cooldown = now - state.low_since, self.settings.cooldown_s
        if lasted < cooldown:
            return hold(Signal.COOLDOWN, f"{why} for {lasted:.0f}s of {cooldown:g}s")
        return self._change(state, pool, n - 1, Signal.LOW_LOAD, f"{why} for {lasted:.0f}s", now)

    def _change(
        self, state: _PoolState, pool: str, replicas: int, signal: Signal, why: str, now: float
    ) -> Decision:
        previous = state.desired if state.desired is not None else replicas
        state.desired, state.changed_at = replicas, now
        state.served_at = state.low_since = state.high_since = None
        return Decision(pool, replicas, previous, signal, why)

    def _up_reason(self, pool: str, signals: Signals) -> tuple[Signal, str] | None:
        """Why the pool should grow now (None: it should not)."""
        s = self.settings
        queue, kv_waiting = signals.queue_time_s, signals.kv_waiting
        utilization = signals.pool(pool).utilization
        kv_bound = kv_waiting >= s.kv_waiting_up
        owns_queue = pool == "prefill" or not self.has_prefill_pool
        if pool == "decode" and kv_bound:
            why = f"{kv_waiting:.1f} requests wait for decode KV blocks (>= {s.kv_waiting_up:g})"
            return Signal.KV_WAITING, why
        if owns_queue and queue > s.target_queue_s and not (pool == "prefill" and kv_bound):
            return Signal.QUEUE_TIME, f"queue time {queue:.2f}s > {s.target_queue_s:g}s"
        if utilization > s.target_utilization:
            return (
                Signal.UTILIZATION,
                f"{pool} utilisation {utilization:.2f} > {s.target_utilization:g}",
            )
        return None

    def _low_reason(self, pool: str, signals: Signals) -> tuple[bool, str]:
        """Whether the pool would stay under `low_utilization` with one replica fewer and nothing
        waits (queue time ~0, no request waiting for decode KV); with the numbers, in words."""
        s = self.settings
        sig = signals.pool(pool)
        if signals.queue_time_s > s.idle_queue_s:
            return False, f"queue time {signals.queue_time_s:.2f}s (~0 is <= {s.idle_queue_s:g}s)"
        if pool == "decode" and signals.kv_waiting > 0:
            return False, f"{signals.kv_waiting:.1f} requests wait for decode KV blocks"
        if sig.ready < 2:
            return False, f"{sig.ready} {pool} replica ready"
        projected = sig.utilization * sig.ready / (sig.ready - 1)
        with_fewer = f"{pool} utilisation with one replica fewer {projected:.2f}"
        if projected >= s.low_utilization:
            return False, f"{with_fewer} >= {s.low_utilization:g}"
        return True, f"{with_fewer} < {s.low_utilization:g} and no queue"
