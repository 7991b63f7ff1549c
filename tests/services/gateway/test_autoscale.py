"""The autoscaler's pure core (`pdmesh_gateway.autoscale`) and its window on the load
(`pdmesh_gateway.load_window`): table-driven decisions (up on queue time, utilisation or KV waits;
down only below the low threshold with one replica fewer, no queue, after a cooldown; never out of
bounds), and a fluctuating signal that cannot make the count flap."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from pdmesh_gateway.autoscale import (
    Autoscaler,
    AutoscaleSettings,
    PoolSignals,
    Signal,
    Signals,
)
from pdmesh_gateway.load_window import LoadWindow
from pdmesh_service.scaling import PoolBounds, parse_bounds

SETTINGS = AutoscaleSettings(
    window_s=10.0,
    target_queue_s=0.5,
    target_utilization=0.8,
    low_utilization=0.3,
    cooldown_s=30.0,
    up_cooldown_s=10.0,
    up_stable_s=0.0,
)
BOUNDS = {"prefill": PoolBounds(1, 3), "decode": PoolBounds(1, 2)}


def signals(
    queue: float = 0.0,
    kv_waiting: float = 0.0,
    prefill: tuple[int, float] = (1, 0.5),
    decode: tuple[int, float] = (1, 0.5),
) -> Signals:
    return Signals(
        queue_time_s=queue,
        kv_waiting=kv_waiting,
        prefill=PoolSignals(*prefill),
        decode=PoolSignals(*decode),
    )


# (name, signals, pool, (desired, signal))  -- a fresh planner, one tick at t=0
FIRST_TICK = [
    ("queue over target grows prefill", signals(queue=0.9), "prefill", (2, Signal.QUEUE_TIME)),
    ("queue under target holds", signals(queue=0.4), "prefill", (1, Signal.STEADY)),
    ("queue time is not decode's", signals(queue=5.0), "decode", (1, Signal.STEADY)),
    (
        "prefill utilisation over target grows it",
        signals(prefill=(1, 0.9)),
        "prefill",
        (2, Signal.UTILIZATION),
    ),
    (
        "KV waits grow decode",
        signals(queue=2.0, kv_waiting=3.0),
        "decode",
        (2, Signal.KV_WAITING),
    ),
    (
        "a queue caused by decode KV does not grow prefill",
        signals(queue=2.0, kv_waiting=3.0),
        "prefill",
        (1, Signal.STEADY),
    ),
    (
        "decode KV utilisation over target grows it",
        signals(decode=(1, 0.95)),
        "decode",
        (2, Signal.UTILIZATION),
    ),
    ("at the maximum: hold", signals(queue=9.0, prefill=(3, 1.0)), "prefill", (3, Signal.BOUNDS)),
    ("ready above max is clamped", signals(prefill=(5, 0.5)), "prefill", (3, Signal.STEADY)),
    ("none ready starts at min", signals(prefill=(0, 0.0)), "prefill", (1, Signal.STEADY)),
    (
        "low load at the minimum holds",
        signals(prefill=(1, 0.0)),
        "prefill",
        (1, Signal.STEADY),
    ),
    (
        "low load starts the cooldown, no change yet",
        signals(prefill=(2, 0.1)),
        "prefill",
        (2, Signal.COOLDOWN),
    ),
    (
        "busy with one fewer: steady",
        signals(prefill=(2, 0.2)),
        "prefill",
        (2, Signal.STEADY),
    ),
]


@pytest.mark.parametrize(
    ("given", "pool", "expected"),
    [case[1:] for case in FIRST_TICK],
    ids=[case[0] for case in FIRST_TICK],
)
def test_first_decision(given: Signals, pool: str, expected: tuple[int, Signal]) -> None:
    decision = Autoscaler(BOUNDS, SETTINGS).plan(given, 0.0)[pool]
    assert (decision.replicas, decision.signal) == expected, decision.reason
    assert decision.reason


def test_agg_mode_lets_the_queue_time_grow_decode_and_has_no_prefill_pool() -> None:
    planner = Autoscaler({"decode": PoolBounds(1, 2)}, SETTINGS, has_prefill_pool=False)
    decision = planner.plan(signals(queue=1.0), 0.0)["decode"]
    assert (decision.replicas, decision.signal) == (2, Signal.QUEUE_TIME)
    with pytest.raises(ValueError, match="agg mode"):
        Autoscaler(BOUNDS, SETTINGS, has_prefill_pool=False)


def run(planner: Autoscaler, timeline: list[tuple[float, Signals]], pool: str) -> list[int]:
    return [planner.plan(s, t)[pool].replicas for t, s in timeline]


def test_scale_down_needs_low_load_for_a_whole_cooldown_and_no_queue() -> None:
    planner = Autoscaler(BOUNDS, SETTINGS)
    low = signals(prefill=(2, 0.1))  # 0.1 x 2 / 1 = 0.2 < 0.3
    assert run(planner, [(t, low) for t in range(0, 30)], "prefill") == [2] * 30
    # a queue blip resets the cooldown
    assert run(planner, [(30.0, replace(low, queue_time_s=0.2))], "prefill") == [2]
    assert run(planner, [(t, low) for t in range(31, 61)], "prefill") == [2] * 30
    decision = planner.plan(low, 61.0)["prefill"]
    assert (decision.replicas, decision.signal, decision.previous) == (1, Signal.LOW_LOAD, 2)


def test_no_step_down_while_a_replica_is_missing_nor_up_while_one_starts() -> None:
    planner = Autoscaler(BOUNDS, SETTINGS)
    assert planner.plan(signals(queue=2.0), 0.0)["prefill"].replicas == 2
    # the new replica is not ready yet: the queue persists, but no third one is asked for
    for t in (11.0, 20.0, 40.0):
        decision = planner.plan(signals(queue=2.0, prefill=(1, 1.0)), t)["prefill"]
        assert (decision.replicas, decision.signal) == (2, Signal.STARTING)
    # ready now, but the window still holds the waits from before: the up cooldown runs from here
    decision = planner.plan(signals(queue=2.0, prefill=(2, 1.0)), 41.0)["prefill"]
    assert (decision.replicas, decision.signal) == (2, Signal.COOLDOWN)
    assert planner.plan(signals(queue=2.0, prefill=(2, 1.0)), 50.0)["prefill"].replicas == 2
    assert planner.plan(signals(queue=2.0, prefill=(2, 1.0)), 51.0)["prefill"].replicas == 3


def test_a_transient_spike_scales_nothing_a_sustained_one_does() -> None:
    planner = Autoscaler(BOUNDS, replace(SETTINGS, up_stable_s=3.0))
    spike, calm = signals(queue=2.0), signals(queue=0.1)
    timeline = [(0.0, spike), (1.0, spike), (2.0, calm), (3.0, spike), (4.0, spike), (5.0, spike)]
    assert run(planner, timeline, "prefill") == [1, 1, 1, 1, 1, 1]
    decision = planner.plan(spike, 6.0)["prefill"]
    assert (decision.replicas, decision.signal) == (2, Signal.QUEUE_TIME)


def test_up_again_waits_for_the_up_cooldown() -> None:
    planner = Autoscaler(BOUNDS, SETTINGS)
    busy = signals(queue=2.0, prefill=(2, 1.0))
    assert planner.plan(signals(queue=2.0), 0.0)["prefill"].replicas == 2
    decision = planner.plan(busy, 5.0)["prefill"]  # served from here on
    assert (decision.replicas, decision.signal) == (2, Signal.COOLDOWN)
    assert planner.plan(busy, 14.0)["prefill"].replicas == 2
    assert planner.plan(busy, 15.0)["prefill"].replicas == 3


def test_never_outside_the_bounds_whatever_the_signals() -> None:
    rng = random.Random(7)
    planner = Autoscaler(BOUNDS, replace(SETTINGS, cooldown_s=0.0, up_cooldown_s=0.0))
    for t in range(2000):
        ready = (rng.randint(0, 5), rng.random() * 1.2)
        given = signals(
            rng.random() * 3, rng.random() * 3, ready, (rng.randint(0, 4), rng.random())
        )
        for pool, decision in planner.plan(given, float(t)).items():
            bounds = BOUNDS[pool]
            assert bounds.min_replicas <= decision.replicas <= bounds.max_replicas
            assert abs(decision.replicas - decision.previous) <= 1


def test_a_fluctuating_signal_does_not_make_the_count_flap() -> None:
    """Load swinging every few seconds between busy-ish and quiet, never crossing the targets with
    one replica more (queue noise under the target, utilisation inside the band): once scaled up by
    a real burst, the pool stays put; over 10 minutes it changes at most twice (up, then down once
    the swings stop)."""
    planner = Autoscaler(BOUNDS, SETTINGS)
    rng = random.Random(3)
    counts, ready = [], 1
    for t in range(600):
        if t < 8:  # a burst, shorter than the up cooldown
            given = signals(queue=1.5, prefill=(ready, 1.0))
        elif t < 500:  # fluctuating inside the hysteresis band
            swing = 0.5 + 0.5 * math.sin(t / 3.0)
            queue = 0.4 * swing * rng.random()  # under the target, but mostly not ~0
            given = signals(queue=queue, prefill=(ready, 0.2 + 0.5 * swing * rng.random()))
        else:  # quiet
            given = signals(prefill=(ready, 0.02))
        replicas = planner.plan(given, float(t))["prefill"].replicas
        ready = replicas  # the launcher follows at once
        counts.append(replicas)
    num_changes = sum(a != b for a, b in zip(counts, counts[1:], strict=False))
    assert max(counts) == 2 and counts[-1] == 1, counts
    assert num_changes <= 2, num_changes


def test_signals_alternating_across_both_thresholds_change_at_most_once_per_cooldown() -> None:
    """The worst case: the signal alternates each tick between over the up target and dead idle;
    changes are still at least min(up_cooldown, cooldown) apart."""
    planner = Autoscaler(BOUNDS, SETTINGS)
    changes, ready = [], 1
    for t in range(300):
        given = signals(queue=2.0, prefill=(ready, 1.0)) if t % 2 else signals(prefill=(ready, 0.0))
        decision = planner.plan(given, float(t))["prefill"]
        if decision.is_change:
            changes.append(t)
        ready = decision.replicas
    gaps = [b - a for a, b in zip(changes, changes[1:], strict=False)]
    assert all(gap >= SETTINGS.up_delay_s for gap in gaps), changes
    assert len(changes) <= 300 / SETTINGS.up_delay_s


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"low_utilization": 0.9}, "low < target"),
        ({"target_utilization": 1.5}, "low < target"),
        ({"window_s": 0}, "window_s"),
        ({"cooldown_s": -1}, "cooldowns"),
    ],
)
def test_settings_are_checked(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AutoscaleSettings(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("prefill=1..3,decode=1..2", {"prefill": (1, 3), "decode": (1, 2)}),
        (" decode = 2..2 ", {"decode": (2, 2)}),
    ],
)
def test_parse_bounds(text: str, expected: dict[str, tuple[int, int]]) -> None:
    parsed = parse_bounds(text)
    assert {p: (b.min_replicas, b.max_replicas) for p, b in parsed.items()} == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prefill=3..1", "min <= max"),
        ("prefill=0..2", "min <= max"),
        ("gateway=1..2", "unknown pool"),
        ("prefill=1..2,prefill=1..3", "twice"),
        ("prefill=1-3", "POOL=MIN..MAX"),
        ("", "names no pool"),
    ],
)
def test_parse_bounds_refuses(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_bounds(text)


# ----- the load window -----


def test_window_queue_time_is_the_p90_wait_or_the_oldest_wait_now() -> None:
    window = LoadWindow(10.0, started_at=0.0)
    for i in range(10):
        ticket = window.arrived(float(i), prompt_tokens=100)
        window.left_queue(ticket, i + 0.1 * (i + 1))  # waits 0.1 .. 1.0
    snap = window.snapshot(10.0, prefill_ready=1, decode_ready=1)
    assert snap.queue_time_s == pytest.approx(0.9)
    assert snap.arrival_rate == pytest.approx(1.0) and snap.mean_prompt_tokens == 100
    stuck = window.arrived(10.0, prompt_tokens=10)
    assert window.snapshot(15.0, 1, 1).queue_time_s == pytest.approx(5.0)  # nobody left yet
    window.ended(stuck, 16.0, output_tokens=0)  # shed or cancelled: its wait counts
    assert window.num_queued == 0
    assert window.snapshot(16.0, 1, 1).queue_time_s == pytest.approx(6.0)
    # past the window nothing is left of the old waits
    assert window.snapshot(40.0, 1, 1).queue_time_s == 0.0


def test_window_means_and_rates_forget_what_is_older_than_the_window() -> None:
    window = LoadWindow(4.0, started_at=0.0)
    for t in range(8):
        window.sample(float(t), prefill_utilization=t / 10, decode_utilization=0.5, kv_waiting=t)
    snap = window.snapshot(7.0, prefill_ready=2, decode_ready=1)
    assert snap.prefill == PoolSignals(2, pytest.approx(0.5))  # samples t=3..7
    assert snap.kv_waiting == pytest.approx(5.0)
    ticket = window.arrived(7.0, 10)
    window.ended(ticket, 7.5, output_tokens=12)
    snap = window.snapshot(8.0, 2, 1)
    assert snap.mean_output_tokens == 12 and snap.arrival_rate == pytest.approx(0.25)
    assert window.snapshot(20.0, 2, 1) == Signals(prefill=PoolSignals(2), decode=PoolSignals(1))


def test_a_ticket_leaves_the_queue_once() -> None:
    window = LoadWindow(10.0)
    ticket = window.arrived(1.0, 5)
    window.left_queue(ticket, 2.0)
    window.left_queue(ticket, 9.0)  # a later start of the same request (a retry, a migration)
    window.ended(ticket, 9.5, output_tokens=3)
    assert window.snapshot(10.0, 1, 1).queue_time_s == pytest.approx(1.0)
