"""The gateway's fair queue: which waiting request starts next (pure: no asyncio, grpc or clock;
the caller passes `now`).

Every new request waits here before its start (`start.Starter`: admission to a prefill rank,
Reserve, Prefill, or a decode rank's Generate), whatever path it then takes. A grant gives it a
start slot, held until its first byte reached the client (`started`) or its end; `capacity` start
slots exist (the adapter sets them from the ranks up). A grant also takes one of its tenant's
`max_concurrency` units, held until the request's end (`finished`).

Order (`pump`): while a start slot is free,
1. starvation promotion: the oldest head of a class below the one strict priority would serve that
   waited `starvation_s` or more goes first (so strict priority cannot starve a class forever);
2. else strict priority across classes (system > interactive > default > batch);
3. within a class, deficit round-robin by tokens across tenants: each visit to a tenant with a
   waiting request adds `quantum_tokens` to its deficit, and its head starts once the deficit covers
   its cost (prompt tokens + max_tokens); one request a visit (the credit left waits for the next
   visit, so a tenant with few requests waiting is not outrun by bursts of a busy one); a tenant
   whose queue empties loses its deficit. So tenants that keep requests waiting get equal tokens,
   whatever they offer.
A tenant is skipped (keeping its place and deficit) while it runs `max_concurrency` requests or
its token bucket is in debt (`next_wakeup` says when a bucket reopens).

Bounds (`enqueue` raises `Rejected`, the adapter's 429): the tenant's `max_queued`; the class's
bound (`class_max_queued`); all classes together (`max_queued`, default QUEUED_PER_SLOT x capacity).
A full class (or queue) refuses only tenants holding their even share of it or more
(`_over_share`), so a flooding tenant cannot lock the others out.
Displacement is done at grant time only: a request of a higher class overtakes every waiting
lower one, but a granted request keeps its slot (it is never stopped to make room).

Stats per (tenant, class): requests and tokens admitted and rejected (by reason: tenant_full,
class_full, full, timeout, client_gone), wait times; `view()` is what /mesh shows.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from pdmesh_gateway.tenants import CLASSES, PriorityClass, TenantLimits, TokenBucket

QUEUED_PER_SLOT = 8  # the default bound on all queued requests: this many per start slot
DEFAULT_QUANTUM_TOKENS = 1024
DEFAULT_STARVATION_S = 30.0
RATE_WINDOW = 64  # grants the drain rate (Retry-After) is measured over
REASONS = ("tenant_full", "class_full", "full", "timeout", "client_gone")


class Rejected(Exception):
    """A request that may not wait: `reason` (one of REASONS), `retry_after_s` the estimate of when
    it may."""

    def __init__(self, message: str, reason: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason, self.retry_after_s = reason, retry_after_s


class EntryState(StrEnum):
    QUEUED = "queued"
    STARTING = "starting"  # granted, no byte sent yet: holds a start slot
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False, slots=True)
class Entry:
    """One request in the queue. `cost`: the tokens it is expected to cost (DRR's packet size)."""

    tenant: str
    priority: PriorityClass
    cost: int
    prompt_tokens: int
    enqueued_at: float
    seq: int = 0
    state: EntryState = EntryState.QUEUED
    granted_at: float | None = None


@dataclass(frozen=True)
class FairQueueConfig:
    """`capacity`: start slots (None: the adapter sets them); `max_queued`: waiting requests of all
    classes (None: QUEUED_PER_SLOT x capacity); `class_max_queued`: per class (absent: none)."""

    capacity: int | None = None
    max_queued: int | None = None
    class_max_queued: Mapping[PriorityClass, int] = field(default_factory=dict)
    starvation_s: float = DEFAULT_STARVATION_S
    quantum_tokens: int = DEFAULT_QUANTUM_TOKENS
    # a slot is held to the request's end, not its first byte: `capacity` bounds the requests in
    # the mesh, so the queue (not the engines' FCFS batches) decides who runs
    hold_until_end: bool = False
    # slots only `system` and `interactive` requests may take (SGLang's reserved slots)
    reserved_slots: int = 0

    def __post_init__(self) -> None:
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"--max-starting must be >= 1, got {self.capacity}")
        if self.max_queued is not None and self.max_queued < 1:
            raise ValueError(f"--max-queued must be >= 1, got {self.max_queued}")
        for cls, bound in self.class_max_queued.items():
            if bound < 0:
                raise ValueError(f"--class-max-queued {cls}: must be >= 0, got {bound}")
        if not self.starvation_s > 0:
            raise ValueError(f"--starvation-s must be positive, got {self.starvation_s}")
        if self.quantum_tokens < 1:
            raise ValueError(f"the DRR quantum must be >= 1 token, got {self.quantum_tokens}")
        if self.reserved_slots < 0:
            raise ValueError(f"--reserved-slots must be >= 0, got {self.reserved_slots}")


@dataclass(slots=True)
class _Tenant:
    limits: TenantLimits
    bucket: TokenBucket | None
    num_running: int = 0  # granted, not finished
    num_queued: int = 0

    def is_eligible(self, now: float) -> bool:
        most = self.limits.max_concurrency
        if most is not None and self.num_running >= most:
            return False
        return self.bucket is None or self.bucket.is_open(now)


@dataclass(slots=True)
class Stats:
    """Counts of one (tenant, class)."""

    admitted_requests: int = 0
    admitted_tokens: int = 0
    rejected_requests: dict[str, int] = field(default_factory=dict)
    rejected_tokens: dict[str, int] = field(default_factory=dict)
    wait_s_total: float = 0.0

    def reject(self, reason: str, tokens: int) -> None:
        self.rejected_requests[reason] = self.rejected_requests.get(reason, 0) + 1
        self.rejected_tokens[reason] = self.rejected_tokens.get(reason, 0) + tokens


class _Band:
    """One class: a FIFO per tenant and the DRR ring over the tenants with waiting requests."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[Entry]] = {}
        self.active: deque[str] = deque()
        self.deficit: dict[str, int] = {}
        self.size = 0

    def push(self, entry: Entry) -> None:
        queue = self.queues.get(entry.tenant)
        if queue is None:
            queue = self.queues[entry.tenant] = deque()
            self.active.append(entry.tenant)
            self.deficit[entry.tenant] = 0
        queue.append(entry)
        self.size += 1

    def remove(self, entry: Entry) -> None:
        queue = self.queues[entry.tenant]
        queue.remove(entry)
        self.size -= 1
        if not queue:
            del self.queues[entry.tenant], self.deficit[entry.tenant]
            self.active.remove(entry.tenant)

    def heads(self) -> Iterable[Entry]:
        return (q[0] for q in self.queues.values())

    def pick(self, is_eligible: Callable[[str], bool], quantum: int) -> Entry | None:
        """The next request by DRR among the eligible tenants (removed), or None."""
        if not any(is_eligible(t) for t in self.active):
            return None
        while True:
            tenant = self.active[0]
            if is_eligible(tenant):
                head = self.queues[tenant][0]
                if self.deficit[tenant] >= head.cost:
                    self.deficit[tenant] -= head.cost
                    self.remove(head)
                    if self.active and self.active[0] == tenant:
                        self.active.rotate(-1)  # one request a visit: its credit waits its turn
                    return head
                self.deficit[tenant] += quantum
            self.active.rotate(-1)


class FairQueue:
    """Strict priority across classes, DRR across tenants, starvation promotion (module
    docstring)."""

    def __init__(self, config: FairQueueConfig, tenants: Iterable[TenantLimits] = ()) -> None:
        self.config = config
        self.capacity = config.capacity or 1
        self.num_starting = 0
        self.num_promoted = 0
        self._bands = {c: _Band() for c in CLASSES}
        self._tenants: dict[str, _Tenant] = {}
        self._stats: dict[tuple[str, PriorityClass], Stats] = {}
        self._grant_times: deque[float] = deque(maxlen=RATE_WINDOW)
        self._seq = itertools.count()
        for limits in tenants:
            self._tenant(limits)

    # ----- views -----
    @property
    def num_queued(self) -> int:
        return sum(b.size for b in self._bands.values())

    @property
    def max_queued(self) -> int:
        return self.config.max_queued or QUEUED_PER_SLOT * self.capacity

    def queued(self, tenant: str, priority: PriorityClass) -> int:
        queue = self._bands[priority].queues.get(tenant)
        return len(queue) if queue else 0

    def running(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return state.num_running if state else 0

    def stats(self) -> dict[tuple[str, PriorityClass], Stats]:
        return self._stats

    def drain_per_s(self, now: float) -> float | None:
        """Grants per second over the last RATE_WINDOW grants; None before two."""
        times = self._grant_times
        if len(times) < 2 or now <= times[0]:
            return None
        return len(times) / (now - times[0])

    # ----- changes -----
    def set_capacity(self, capacity: int) -> None:
        if self.config.capacity is None:
            self.capacity = max(capacity, 1)

    def enqueue(
        self,
        limits: TenantLimits,
        priority: PriorityClass,
        cost: int,
        prompt_tokens: int,
        now: float,
    ) -> Entry:
        """Queue a request (then `pump`); `Rejected` when a bound is reached."""
        tenant = self._tenant(limits)
        entry = Entry(limits.tenant, priority, max(cost, 1), prompt_tokens, now, next(self._seq))
        band = self._bands[priority]
        class_bound = self.config.class_max_queued.get(priority)
        if limits.max_queued is not None and tenant.num_queued >= limits.max_queued:
            self._reject(entry, "tenant_full", tenant.num_queued - limits.max_queued + 1, now)
        if class_bound is not None and band.size >= class_bound and self._over_share(band, entry):
            self._reject(entry, "class_full", band.size - class_bound + 1, now)
        if self.num_queued >= self.max_queued and self._over_share(None, entry):
            self._reject(entry, "full", self.num_queued - self.max_queued + 1, now)
        band.push(entry)
        tenant.num_queued += 1
        self._stat(entry)  # its row exists from its first request on
        return entry

    def pump(self, now: float) -> list[Entry]:
        """Grant free start slots (module docstring's order); the entries granted, in order."""
        granted: list[Entry] = []
        while self.num_starting < self.capacity:
            entry = self._promoted(now) or self._next(now)
            if entry is None:
                break
            self._grant(entry, now)
            granted.append(entry)
        return granted

    def started(self, entry: Entry) -> None:
        """The request's first byte went out: its start slot is free (then `pump`), unless slots
        are held until the end (`hold_until_end`)."""
        if entry.state is EntryState.STARTING:
            self.num_starting -= not self.config.hold_until_end
            entry.state = EntryState.RUNNING

    def finished(self, entry: Entry) -> None:
        """The granted request ended (then `pump`)."""
        if entry.state is EntryState.STARTING:
            self.num_starting -= 1
        elif entry.state is EntryState.RUNNING:
            self.num_starting -= self.config.hold_until_end
        if entry.state in (EntryState.STARTING, EntryState.RUNNING):
            self._tenants[entry.tenant].num_running -= 1
            entry.state = EntryState.DONE

    def leave(self, entry: Entry, reason: str, now: float) -> None:
        """A queued request left without a grant (timeout, client gone): counted as rejected."""
        if entry.state is not EntryState.QUEUED:
            return
        self._bands[entry.priority].remove(entry)
        self._tenants[entry.tenant].num_queued -= 1
        entry.state = EntryState.DONE
        self._stat(entry).reject(reason, entry.cost)

    def charge(self, entry: Entry, tokens: int, now: float) -> None:
        """Output tokens of a granted request, into its tenant's bucket."""
        bucket = self._tenants[entry.tenant].bucket
        if bucket is not None and tokens > 0:
            bucket.charge(tokens, now)

    def next_wakeup(self, now: float) -> float | None:
        """When a waiting tenant's bucket reopens, if that may grant a request (a slot is free and
        the tenant is skipped for its bucket alone); None otherwise."""
        if self.num_starting >= self.capacity:
            return None
        times = []
        for tenant in self._tenants.values():
            most = tenant.limits.max_concurrency
            if tenant.num_queued == 0 or tenant.bucket is None:
                continue
            if most is None or tenant.num_running < most:
                times.append(tenant.bucket.opens_at(now))
        later = [t for t in times if t > now]
        return min(later) if later else None

    # ----- internals -----
    def _tenant(self, limits: TenantLimits) -> _Tenant:
        tenant = self._tenants.get(limits.tenant)
        if tenant is None:
            rate = limits.max_tokens_per_s
            tenant = _Tenant(limits, None if rate is None else TokenBucket(rate))
            self._tenants[limits.tenant] = tenant
        return tenant

    def _stat(self, entry: Entry) -> Stats:
        return self._stats.setdefault((entry.tenant, entry.priority), Stats())

    def _reject(self, entry: Entry, reason: str, excess: int, now: float) -> None:
        self._stat(entry).reject(reason, entry.cost)
        rate = self.drain_per_s(now)
        where = {"tenant_full": f"tenant {entry.tenant!r}", "class_full": f"class {entry.priority}"}
        raise Rejected(
            f"too many requests are queued for {where.get(reason, 'the gateway')}; retry later",
            reason,
            excess / rate if rate else 1.0,
        )

    def _over_share(self, band: _Band | None, entry: Entry) -> bool:
        """Whether the entry's tenant holds its even share or more of a full queue (`band`, or all
        of them): only such a tenant is refused, so a flooding tenant cannot lock the others out;
        the queue then grows past its bound until the waiting tenants hold even shares."""
        bands = [band] if band is not None else list(self._bands.values())
        holders = {t for b in bands for t in b.queues} | {entry.tenant}
        held = sum(len(b.queues.get(entry.tenant, ())) for b in bands)
        total = sum(b.size for b in bands)
        return held >= total / len(holders)

    def _promoted(self, now: float) -> Entry | None:
        """The oldest starved head of a class below the most urgent one with a tenant that may
        start (that class is what starves it), whose own tenant may start; or None."""
        top = next(
            (
                c
                for c in CLASSES
                if any(self._tenants[t].is_eligible(now) for t in self._bands[c].active)
            ),
            None,
        )
        starved = [
            head
            for cls in CLASSES
            if top is not None and cls > top
            for head in self._bands[cls].heads()
            if now - head.enqueued_at >= self.config.starvation_s
            and self._tenants[head.tenant].is_eligible(now)
        ]
        if not starved:
            return None
        entry = min(starved, key=lambda e: e.seq)
        band = self._bands[entry.priority]
        band.remove(entry)
        if entry.tenant in band.deficit:  # it still waits there: the promotion is charged
            band.deficit[entry.tenant] -= entry.cost
        self.num_promoted += 1
        return entry

    def _next(self, now: float) -> Entry | None:
        def is_eligible(name: str) -> bool:
            return self._tenants[name].is_eligible(now)

        free = self.capacity - self.num_starting
        for cls in CLASSES:
            if cls > PriorityClass.INTERACTIVE and free <= self.config.reserved_slots:
                break  # the last slots are kept for urgent requests
            if self._bands[cls].size:
                entry = self._bands[cls].pick(is_eligible, self.config.quantum_tokens)
                if entry is not None:
                    return entry
        return None

    def _grant(self, entry: Entry, now: float) -> None:
        tenant = self._tenants[entry.tenant]
        tenant.num_queued -= 1
        tenant.num_running += 1
        self.num_starting += 1
        entry.state, entry.granted_at = EntryState.STARTING, now
        if tenant.bucket is not None:
            tenant.bucket.charge(entry.prompt_tokens, now)
        stats = self._stat(entry)
        stats.admitted_requests += 1
        stats.admitted_tokens += entry.cost
        stats.wait_s_total += now - entry.enqueued_at
        self._grant_times.append(now)

    def view(self, now: float) -> dict[str, object]:
        """What /mesh shows: the slots, bounds and per tenant and class the counts."""
        rows = []
        for (name, cls), s in sorted(self._stats.items()):
            rows.append(
                {
                    "tenant": name,
                    "class": str(cls),
                    "queued": self.queued(name, cls),
                    "admitted_requests": s.admitted_requests,
                    "admitted_tokens": s.admitted_tokens,
                    "rejected_requests": dict(s.rejected_requests),
                    "rejected_tokens": dict(s.rejected_tokens),
                    "mean_wait_s": round(s.wait_s_total / s.admitted_requests, 4)
                    if s.admitted_requests
                    else None,
                }
            )
        return {
            "start_slots": self.capacity,
            "starting": self.num_starting,
            "queued": self.num_queued,
            "max_queued": self.max_queued,
            "promoted": self.num_promoted,
            "running": {n: t.num_running for n, t in sorted(self._tenants.items())},
            "classes": rows,
        }
