"""The EPLB contract in Redis: what DEP ranks report, what the controller publishes, and how they
agree.

    every DEP rank   --publish_load-->  eplb:load:{instance}:{model}:{rank}   LoadReport (TTL ~30 s)
    controller       --read_loads-->    plans from the reports of ranks on the current version
    controller       --write_placement (compare-and-set V-1 -> V)-->
                     eplb:placement:{instance}:{model}
                     (in the same script: eplb:versions:{instance}:{model}[V] = the placement, and
                     eplb:history:{instance}:{model} gains its RebalanceRecord, newest first)
    every DEP rank   --read_placement-->  sees V > running; stages the expert weights it lacks for V
    all ranks        switch to V at ONE step boundary, once every rank has staged V (agreed through
                     their per-step DP sync), restart their load window, report running_version = V
    operator         --set_enabled-->   eplb:enabled:{instance}   the Off switch (absent: the
                                                                   default)

Keys live under the deployment namespace (`pdmesh:{deployment}:eplb:...`, as `registry.namespace`).
(instance, model) is the unit of balancing: prefill and decode instances are separate instances, and
an instance's "target" and "draft" models (different E, L, P) are planned independently.

Invariants:
- Versions of one (instance, model) form a chain 0, 1, 2, ...: `write_placement` succeeds only as
  previous_version -> previous_version + 1 (a Lua compare-and-set), so two controllers, or a
  restarted one, can never fork a version. Version 0 is the checkpoint's initial placement (slot s
  holds expert s % E) and is never written.
- A rank never runs a version the other ranks of its instance do not run: it switches only at the
  step boundary where every rank has staged that version.
- The controller's death at any point leaves the instance on one version: it either wrote V (one
  atomic SET, with its history record in the same script) or it did not; the ranks keep running what
  they run.
- `slot_counts` of a report are all recorded under `running_version`: a rank restarts its window
  when it switches, so `window_steps` counts steps since the switch, capped at its ring size.

Shapes: L = MoE layers of the model, P = physical slots (E logical experts + S redundant), R =
ranks; slot s lives on rank s // (P / R). `physical_to_logical[l][s]` is the logical expert of slot
s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # the records import no transport: pure cores use them
    import redis.asyncio as aioredis

__all__ = [
    "HISTORY_LIMIT",
    "LOAD_TTL_S",
    "EplbSummary",
    "LoadReport",
    "Placement",
    "RebalanceReason",
    "RebalanceRecord",
    "append_history",
    "enabled_key",
    "history_key",
    "identity_placement",
    "is_enabled",
    "load_key",
    "placement_key",
    "publish_load",
    "read_history",
    "read_loads",
    "read_placement",
    "set_enabled",
    "slot_balancedness",
    "summarize",
    "summarize_all",
    "tracked",
    "versions_key",
    "write_placement",
]

LOAD_TTL_S = 30.0  # a rank that stops reporting drops out of planning after this
HISTORY_LIMIT = 100  # records kept per (instance, model)
RebalanceReason = Literal["interval", "manual"]


def _known(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The keys `cls` has: a record written by a newer release, which may hold more, still reads."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in values.items() if k in names}


def _check_name(kind: str, value: str) -> None:
    if not value or ":" in value:
        raise ValueError(f"{kind} must be non-empty and free of ':', got {value!r}")


def _check_matrix(name: str, rows: list[list[int]]) -> tuple[list[list[int]], int]:
    """Rows as lists of ints, all of one width; returns (rows, width). ValueError when ragged or
    empty."""
    out = [[int(v) for v in row] for row in rows]
    width = len(out[0]) if out else 0
    if not out or width == 0 or any(len(row) != width for row in out):
        raise ValueError(f"{name} must be a non-empty rectangular [L][P] list")
    return out, width


@dataclass(frozen=True)
class LoadReport:
    """One DEP rank's expert loads for one model: tokens IT routed to every physical slot (all P of
    them).

    slot_counts [L][P]: tokens routed to slot s of MoE layer l over the last `window_steps` steps,
    all recorded under `running_version`. step: the rank's step counter; switch_step: its step when
    it started running `running_version` (0 for version 0), so step - switch_step is how long that
    version has run. staged_version: the newest version whose weights this rank holds ready (==
    running when none pending). expert_bytes: bytes of one expert's weights (0: unknown). num_nodes:
    nodes the instance's ranks span.
    """

    instance: str
    model: str  # "target" or "draft"
    rank: int
    dp_size: int  # R: ranks of the instance
    step: int
    window_steps: int
    running_version: int
    staged_version: int
    slot_counts: list[list[int]]  # [L][P]
    num_logical: int  # E
    switch_step: int = 0
    expert_bytes: int = 0
    num_nodes: int = 1
    created_ms: int = 0

    def __post_init__(self) -> None:
        _check_name("instance", self.instance)
        _check_name("model", self.model)
        counts, num_slots = _check_matrix("slot_counts", self.slot_counts)
        object.__setattr__(self, "slot_counts", counts)
        if not 0 <= self.rank < self.dp_size:
            raise ValueError(f"rank {self.rank} outside [0, {self.dp_size})")
        if num_slots % self.dp_size or not 0 < self.num_logical <= num_slots:
            raise ValueError(
                f"{num_slots} slots do not fit {self.dp_size} ranks and {self.num_logical} experts"
            )
        if (
            min(
                self.window_steps,
                self.running_version,
                self.staged_version,
                self.switch_step,
                self.expert_bytes,
            )
            < 0
            or self.num_nodes < 1
            or self.step < self.switch_step
        ):
            raise ValueError("negative count, num_nodes < 1, or step before switch_step")

    @property
    def num_layers(self) -> int:
        return len(self.slot_counts)

    @property
    def num_slots(self) -> int:
        return len(self.slot_counts[0])

    @property
    def steps_since_switch(self) -> int:
        return self.step - self.switch_step

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> LoadReport:
        return cls(**_known(cls, json.loads(raw)))


@dataclass(frozen=True)
class Placement:
    """The version the instance must run: `physical_to_logical` [L][P], slot s on rank s // (P /
    R)."""

    instance: str
    model: str
    version: int
    num_ranks: int
    physical_to_logical: list[list[int]]  # [L][P]
    created_ms: int = 0

    def __post_init__(self) -> None:
        _check_name("instance", self.instance)
        _check_name("model", self.model)
        p2l, num_slots = _check_matrix("physical_to_logical", self.physical_to_logical)
        object.__setattr__(self, "physical_to_logical", p2l)
        if self.version < 0 or self.num_ranks < 1 or num_slots % self.num_ranks:
            raise ValueError(
                f"version {self.version} < 0 or {num_slots} slots not split over {self.num_ranks} "
                "ranks"
            )

    @property
    def num_layers(self) -> int:
        return len(self.physical_to_logical)

    @property
    def num_slots(self) -> int:
        return len(self.physical_to_logical[0])

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Placement:
        return cls(**_known(cls, json.loads(raw)))


def identity_placement(
    instance: str, model: str, num_ranks: int, num_layers: int, num_slots: int, num_logical: int
) -> Placement:
    """Version 0: the checkpoint's initial layout, slot s holding expert s % E in every layer."""
    row = [s % num_logical for s in range(num_slots)]
    return Placement(instance, model, 0, num_ranks, [list(row) for _ in range(num_layers)])


@dataclass(frozen=True)
class RebalanceRecord:
    """One published version: what moved and what it bought (balancedness on the window it was
    planned from)."""

    version: int
    created_ms: int
    reason: RebalanceReason
    num_slots_moved: int
    num_bytes_moved: int  # slots moved x bytes per expert (0 when the reports did not say)
    balancedness_before: float
    balancedness_after: float
    plan_ms: float

    def __post_init__(self) -> None:
        if self.reason not in ("interval", "manual"):
            raise ValueError(f"reason must be 'interval' or 'manual', got {self.reason!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> RebalanceRecord:
        return cls(**_known(cls, json.loads(raw)))


# --------------------------------------------------------------------------------------------- keys


def _eplb(deployment: str) -> str:
    # == f"{registry.namespace(deployment)}:eplb", spelled out: registry imports Redis, this module
    # may not
    return f"pdmesh:{deployment}:eplb"


def load_key(deployment: str, instance: str, model: str, rank: int) -> str:
    return f"{_eplb(deployment)}:load:{instance}:{model}:{rank}"


def placement_key(deployment: str, instance: str, model: str) -> str:
    return f"{_eplb(deployment)}:placement:{instance}:{model}"


def history_key(deployment: str, instance: str, model: str) -> str:
    return f"{_eplb(deployment)}:history:{instance}:{model}"


def versions_key(deployment: str, instance: str, model: str) -> str:
    """Hash version -> Placement JSON of the last HISTORY_LIMIT versions written."""
    return f"{_eplb(deployment)}:versions:{instance}:{model}"


def enabled_key(deployment: str, instance: str) -> str:
    return f"{_eplb(deployment)}:enabled:{instance}"


# --------------------------------------------------------------------------------------- operations


async def publish_load(
    redis: aioredis.Redis, deployment: str, report: LoadReport, ttl_s: float = LOAD_TTL_S
) -> None:
    key = load_key(deployment, report.instance, report.model, report.rank)
    await redis.set(key, report.to_json(), px=int(ttl_s * 1000))


async def _scan_values(redis: aioredis.Redis, pattern: str) -> list[bytes | str]:
    keys = sorted([k async for k in redis.scan_iter(match=pattern, count=500)])
    return [v for v in await redis.mget(keys) if v is not None] if keys else []


async def read_loads(
    redis: aioredis.Redis, deployment: str, instance: str, model: str
) -> list[LoadReport]:
    """The live reports of one (instance, model), sorted by rank; a malformed one counts as
    absent."""
    _check_name("instance", instance)
    _check_name("model", model)
    found = []
    for value in await _scan_values(redis, f"{_eplb(deployment)}:load:{instance}:{model}:*"):
        try:
            found.append(LoadReport.from_json(value))
        except (ValueError, TypeError):  # a JSON error is a ValueError
            continue
    return sorted(found, key=lambda r: r.rank)


async def tracked(redis: aioredis.Redis, deployment: str) -> list[tuple[str, str]]:
    """Every (instance, model) with at least one live load report, sorted."""
    prefix = f"{_eplb(deployment)}:load:"
    found: set[tuple[str, str]] = set()
    async for key in redis.scan_iter(match=prefix + "*", count=500):
        parts = (key.decode() if isinstance(key, bytes) else key)[len(prefix) :].split(":")
        if len(parts) == 3:
            found.add((parts[0], parts[1]))
    return sorted(found)


async def read_placement(
    redis: aioredis.Redis, deployment: str, instance: str, model: str, version: int | None = None
) -> Placement | None:
    """The version the instance must run (`version` None), or that past version while among the last
    HISTORY_LIMIT written; None while it runs version 0 (nothing written yet) or for an unknown
    version."""
    if version is None:
        raw = await redis.get(placement_key(deployment, instance, model))
    else:
        raw = await redis.hget(versions_key(deployment, instance, model), str(version))
    return None if raw is None else Placement.from_json(raw)


# KEYS: placement, history, versions. ARGV: expected current version, new version, placement JSON,
# record JSON or "", limit. Returns 1 when the placement key held version ARGV[1] (absent = 0) and
# was replaced (the placement also kept under its version, the oldest beyond `limit` dropped), else
# 0.
_CAS_SCRIPT = """
local current = redis.call('GET', KEYS[1])
local version = 0
if current then version = tonumber(cjson.decode(current)['version']) end
if version ~= tonumber(ARGV[1]) then return 0 end
local limit = tonumber(ARGV[5])
redis.call('SET', KEYS[1], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
redis.call('HDEL', KEYS[3], tostring(tonumber(ARGV[2]) - limit))
if ARGV[4] ~= '' then
  redis.call('LPUSH', KEYS[2], ARGV[4])
  redis.call('LTRIM', KEYS[2], 0, limit - 1)
end
return 1
"""


async def write_placement(
    redis: aioredis.Redis,
    deployment: str,
    placement: Placement,
    previous_version: int,
    record: RebalanceRecord | None = None,
) -> bool:
    """Publish `placement` iff the current version is `previous_version` and placement.version is
    the next one.

    Atomic (one Lua script): `record`, when given, is appended to the history in the same step, so a
    published version always has its record. Returns whether it was written.
    """
    if placement.version != previous_version + 1:
        raise ValueError(f"version {placement.version} does not follow {previous_version}")
    if record is not None and record.version != placement.version:
        raise ValueError(
            f"record of version {record.version} for placement version {placement.version}"
        )
    where = (deployment, placement.instance, placement.model)
    keys = [placement_key(*where), history_key(*where), versions_key(*where)]
    args: list[str | int] = [
        previous_version,
        placement.version,
        placement.to_json(),
        "" if record is None else record.to_json(),
        HISTORY_LIMIT,
    ]
    return bool(await redis.eval(_CAS_SCRIPT, len(keys), *keys, *args))


async def append_history(
    redis: aioredis.Redis, deployment: str, instance: str, model: str, record: RebalanceRecord
) -> None:
    key = history_key(deployment, instance, model)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.lpush(key, record.to_json())
        pipe.ltrim(key, 0, HISTORY_LIMIT - 1)
        await pipe.execute()


async def read_history(
    redis: aioredis.Redis, deployment: str, instance: str, model: str, limit: int = HISTORY_LIMIT
) -> list[RebalanceRecord]:
    """Newest first."""
    raw = await redis.lrange(history_key(deployment, instance, model), 0, max(limit, 1) - 1)
    return [RebalanceRecord.from_json(r) for r in raw]


async def set_enabled(redis: aioredis.Redis, deployment: str, instance: str, on: bool) -> None:
    """The Off switch of one instance (all its models): periodic rebalances stop; manual ones still
    work."""
    _check_name("instance", instance)
    await redis.set(enabled_key(deployment, instance), b"1" if on else b"0")


async def is_enabled(
    redis: aioredis.Redis, deployment: str, instance: str, default: bool | None = True
) -> bool | None:
    """The switch of `instance`; `default` (the controller's `--no-rebalance` setting) when never
    set."""
    raw = await redis.get(enabled_key(deployment, instance))
    return default if raw is None else raw == b"1"


# ------------------------------------------------------------------------------------------ summary


def slot_balancedness(
    reports: list[LoadReport] | tuple[LoadReport, ...], version: int
) -> float | None:
    """Realised window balancedness of the ranks running `version`: per layer, tokens per rank (the
    sum of its slots' counts over all reporting ranks) mean / max, averaged over layers with tokens.
    1.0 when no token was routed; None when no rank runs `version` or the reports disagree on the
    shape."""
    current = [r for r in reports if r.running_version == version]
    if not current or len({(r.dp_size, r.num_layers, r.num_slots) for r in current}) > 1:
        return None
    num_ranks, per_rank = current[0].dp_size, current[0].num_slots // current[0].dp_size
    values = []
    for layer in range(current[0].num_layers):
        slots = [sum(r.slot_counts[layer][s] for r in current) for s in range(current[0].num_slots)]
        ranks = [sum(slots[k * per_rank : (k + 1) * per_rank]) for k in range(num_ranks)]
        if max(ranks) > 0:
            values.append(sum(ranks) / num_ranks / max(ranks))
    return sum(values) / len(values) if values else 1.0


@dataclass(frozen=True)
class EplbSummary:
    """One (instance, model) at a glance: what the controller's Status and the gateway's /mesh
    show."""

    instance: str
    model: str
    version: int  # published (0: the checkpoint's placement)
    reports: tuple[LoadReport, ...]  # live, by rank
    balancedness: float | None  # `slot_balancedness` of `version`
    last_rebalance: RebalanceRecord | None
    is_enabled: bool | None  # None: never set, the controller's default applies

    @property
    def running_versions(self) -> dict[int, int]:
        return {r.rank: r.running_version for r in self.reports}

    def to_dict(self) -> dict[str, object]:
        """The /mesh form: versions, ranks' running versions, balancedness now, the last
        rebalance."""
        last = self.last_rebalance
        return {
            "instance": self.instance,
            "model": self.model,
            "version": self.version,
            "enabled": self.is_enabled,
            "balancedness": self.balancedness,
            "running_versions": {str(k): v for k, v in self.running_versions.items()},
            "last_rebalance": None if last is None else asdict(last),
        }


async def summarize(
    redis: aioredis.Redis,
    deployment: str,
    instance: str,
    model: str,
    default_enabled: bool | None = True,
) -> EplbSummary:
    """`default_enabled`: what an unset switch reads as (None where the controller's flag is
    unknown)."""
    reports = tuple(await read_loads(redis, deployment, instance, model))
    placement = await read_placement(redis, deployment, instance, model)
    version = 0 if placement is None else placement.version
    history = await read_history(redis, deployment, instance, model, limit=1)
    return EplbSummary(
        instance,
        model,
        version,
        reports,
        slot_balancedness(reports, version),
        history[0] if history else None,
        await is_enabled(redis, deployment, instance, default_enabled),
    )


async def summarize_all(
    redis: aioredis.Redis, deployment: str, default_enabled: bool | None = True
) -> list[EplbSummary]:
    """`summarize` of every tracked (instance, model), sorted."""
    return [
        await summarize(redis, deployment, i, m, default_enabled)
        for i, m in await tracked(redis, deployment)
    ]
