"""How busy the rest of a shared host was while `pdmesh bench costs` measured (Linux `/proc/stat`).

On a small shared machine another process's work inflates a timed step, and a multi-threaded step
most (an OpenMP region waits for its descheduled thread), so each measurement is checked:

    others = busy CPU seconds of the whole host - CPU seconds of this process and of its children
             that have been waited for, over the measurement

and counts as contended when others > QUIET * wall * cores + SLACK_TICKS clock ticks per core (the
counters move in ticks). `HostGuard.guarded(measure)` (with `tries` > 1) first waits for a quiet
`SETTLE_S` window (at most `max_wait_s`), then measures; a contended measurement is done again,
at most `tries` times in all, and the last one is kept and counted; once `budget_s` has been
waited in all, measurements are only checked and counted. Without `/proc/stat` (not
Linux) every measurement counts as quiet.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")
QUIET = 0.08  # others' share of the machine below which a measurement stands
SLACK_TICKS = 3
SETTLE_S = 0.5
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal of the `cpu` line


@dataclass(frozen=True)
class Snapshot:
    wall: float
    host_busy_s: float | None  # None: no /proc/stat
    own_s: float  # this process and its waited-for children


def snapshot() -> Snapshot:
    times = os.times()
    own = times.user + times.system + times.children_user + times.children_system
    return Snapshot(time.monotonic(), _host_busy_s(), own)


def _host_busy_s() -> float | None:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()[1:]
        ticks = os.sysconf("SC_CLK_TCK")
        return sum(int(fields[i]) for i in _BUSY_FIELDS) / ticks
    except (OSError, ValueError, IndexError):
        return None


def others_since(before: Snapshot) -> tuple[float, bool]:
    """(others' share of the machine since `before`, whether that counts as contended); (0, False)
    when unknown."""
    now = snapshot()
    wall = now.wall - before.wall
    if before.host_busy_s is None or now.host_busy_s is None or wall <= 0:
        return 0.0, False
    cores = os.cpu_count() or 1
    others = (now.host_busy_s - before.host_busy_s) - (now.own_s - before.own_s)
    slack = SLACK_TICKS * cores / os.sysconf("SC_CLK_TCK")
    return max(0.0, others / (wall * cores)), others > QUIET * wall * cores + slack


def wait_quiet(max_wait_s: float) -> float:
    """Sleep in `SETTLE_S` windows until one is quiet or `max_wait_s` passed; the seconds
    waited."""
    start = time.monotonic()
    while time.monotonic() - start < max_wait_s:
        before = snapshot()
        time.sleep(SETTLE_S)
        if not others_since(before)[1]:
            break
    return time.monotonic() - start


@dataclass
class HostGuard:
    """Counts over a run: measurements repeated, kept though contended, seconds waited, and the
    worst share others took of a measurement that was kept. `tries` 1: check and count only."""

    say: Callable[[str], None]
    tries: int = 4
    max_wait_s: float = 60.0  # per try
    budget_s: float = 300.0  # waited in all, past which measurements are only checked and counted
    num_repeated: int = 0
    waited_s: float = 0.0
    kept: list[float] = field(default_factory=list)
    contended: list[str] = field(default_factory=list)  # what was kept contended

    def guarded(self, what: str, measure: Callable[[], T]) -> T:
        for attempt in range(1, self.tries + 1):
            patient = self.tries > 1 and self.waited_s < self.budget_s
            if patient:
                self.waited_s += wait_quiet(min(self.max_wait_s, self.budget_s - self.waited_s))
            before = snapshot()
            result = measure()
            share, contended = others_since(before)
            if not contended or attempt == self.tries or not patient:
                self.kept.append(share)
                if contended:
                    self.contended.append(f"{what} ({share:.0%})")
                    self.say(f"{what}: kept, though other work took {share:.0%} of the host")
                return result
            self.num_repeated += 1
            self.say(f"{what}: other work took {share:.0%} of the host; once more")
        raise ValueError("HostGuard needs tries >= 1")

    def note(self) -> str:
        worst = max(self.kept, default=0.0)
        return (
            f"host check: a measurement during which other processes used more than {QUIET:.0%} "
            f"of the machine was done again (each try after a quiet {SETTLE_S:g} s, waited for "
            f"up to {self.max_wait_s:g} s, {self.budget_s:g} s in all), at most {self.tries} "
            f"tries: {self.num_repeated} repeated, {self.waited_s:.0f} s waited; the worst share "
            f"kept {worst:.0%}; kept contended: {', '.join(self.contended) or 'none'}"
        )
