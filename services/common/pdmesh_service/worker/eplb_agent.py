"""A DEP rank's side of EPLB: report expert loads to Redis, stage the placements the controller
publishes.

Every `report_s` seconds (one asyncio task per rank, started by `run_worker`), for each model of
the engine whose experts are balanced (`EngineCore.expert_models`: "target", and "draft" for a
speculative draft model with MoE layers):

    engine thread (EngineLoop.submit):  snapshot = versions, step counters, [L][P] load window
                                        (one host sync)
    Redis:   publish_load(LoadReport(instance=<base id>, model, rank, dp_size, ...))
    Redis:   read_placement(instance, model)  -> version V
    V > running and V > staged, shape fits:  engine thread: EngineCore.stage_placement(V, rows,
                                              model) (returns at once; the engine switches at a
                                              step boundary once every rank staged V, see
                                              pdmesh_engine.parallel.dep)

`instance` is the DEP instance's id without the `-r<rank>` suffix, so all its ranks report under one
key. An elastic instance's ranks report their rank and size in the group as it is now (it
re-forms without a lost rank and grows back), so the controller plans over the live ranks.
Redis errors are logged and retried at the next tick: decode goes on while Redis or the
controller is down. The target's decoder MoE layers ("target") and the draft model's ("draft") are
reported and staged as two models; the MTP layers keep their placement. The placement versions are
reported through the LoadReport only (the heartbeat's `Load` has no field for them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from pdmesh_engine.engine_core import TARGET, EngineCore
from pdmesh_service.eplb_protocol import LoadReport, Placement, publish_load, read_placement
from pdmesh_service.errors import Unavailable
from pdmesh_service.logging import get_logger
from pdmesh_service.tasks import pause

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from pdmesh_service.worker.engine_loop import EngineLoop

log = get_logger(__name__)
DEFAULT_REPORT_S = 1.0


@dataclass(frozen=True)
class EPLBAgentConfig:
    """Who this rank is in the EPLB contract (pdmesh_service.eplb_protocol)."""

    deployment: str
    instance: str  # the DEP instance's base id (no -r<rank> suffix)
    rank: int
    dp_size: int
    report_s: float = DEFAULT_REPORT_S

    def __post_init__(self) -> None:
        if not self.report_s > 0:
            raise ValueError(
                f"--eplb-report-s must be positive to run the agent, got {self.report_s}"
            )
        if not 0 <= self.rank < self.dp_size:
            raise ValueError(f"rank {self.rank} outside [0, {self.dp_size})")


@dataclass(frozen=True)
class RankSnapshot:
    """What the engine thread hands back in one command (see `snapshot`)."""

    step: int
    switch_step: int
    window_steps: int
    running_version: int
    staged_version: int
    slot_counts: list[list[int]]  # [L][P]
    num_logical: int
    expert_bytes: int
    group: tuple[int, int] | None = None  # (rank, ranks) of an elastic group now; None: static


@dataclass(frozen=True)
class TickResult:
    """One tick's outcome (returned for tests and callers; nothing here is logged)."""

    reported: bool
    placement_version: int  # the controller's current version (0: none published)
    staged: bool  # stage_placement accepted that version this tick


def base_instance(instance_id: str, rank: int, dp_size: int) -> str:
    """The DEP instance's id: `instance_id` without its `-r<rank>` suffix (unchanged for a single
    rank)."""
    suffix = f"-r{rank}"
    return (
        instance_id[: -len(suffix)] if dp_size > 1 and instance_id.endswith(suffix) else instance_id
    )


def snapshot(engine: EngineCore, model: str = TARGET) -> RankSnapshot:
    """Engine thread: `model`'s versions, step counters and load window (one host sync for all
    layers)."""
    expert_model = engine.expert_models[model]
    window_steps, _, counts = expert_model.load_window()
    step, switch_step = expert_model.load_steps()
    return RankSnapshot(
        step,
        switch_step,
        window_steps,
        expert_model.stager.running_version,
        expert_model.stager.staged_version,
        counts,
        expert_model.num_logical,
        expert_model.bytes_per_expert,
        _elastic_group(engine),
    )


def _elastic_group(engine: EngineCore) -> tuple[int, int] | None:
    dep = getattr(engine, "dep", None)
    elastic = dep.elastic if dep is not None else None
    return (elastic.rank, elastic.size) if elastic is not None else None


def group_of(config: EPLBAgentConfig, shot: RankSnapshot) -> tuple[int, int]:
    """(rank, dp_size) this rank reports under: an elastic group's current ones."""
    return shot.group if shot.group is not None else (config.rank, config.dp_size)


def load_report(config: EPLBAgentConfig, shot: RankSnapshot, model: str = TARGET) -> LoadReport:
    return LoadReport(
        config.instance,
        model,
        *group_of(config, shot),
        shot.step,
        shot.window_steps,
        shot.running_version,
        shot.staged_version,
        shot.slot_counts,
        shot.num_logical,
        switch_step=shot.switch_step,
        expert_bytes=shot.expert_bytes,
        created_ms=int(time.time() * 1000),
    )


def wanted(placement: Placement | None, shot: RankSnapshot, dp_size: int) -> bool:
    """Whether `placement` is a newer version this rank should stage (and fits its shape)."""
    if placement is None or placement.version <= max(shot.running_version, shot.staged_version):
        return False
    num_slots = len(shot.slot_counts[0]) if shot.slot_counts else 0
    return (
        placement.num_ranks == dp_size
        and placement.num_layers == len(shot.slot_counts)
        and placement.num_slots == num_slots
    )


async def tick(
    loop: EngineLoop, redis: aioredis.Redis, config: EPLBAgentConfig
) -> dict[str, TickResult]:
    """Report once per balanced model, then stage the controller's placement of each where it is
    newer; the outcome by model. Raises RedisError / Unavailable."""
    return {
        model: await tick_model(loop, redis, config, model) for model in loop.engine.expert_models
    }


async def tick_model(
    loop: EngineLoop, redis: aioredis.Redis, config: EPLBAgentConfig, model: str = TARGET
) -> TickResult:
    """`tick` for one model ("target" or "draft")."""
    engine = loop.engine
    shot: RankSnapshot = await loop.submit(snapshot, engine, model)
    if not shot.slot_counts:  # no MoE layer: nothing to balance
        return TickResult(False, 0, False)
    await publish_load(redis, config.deployment, load_report(config, shot, model))
    placement = await read_placement(redis, config.deployment, config.instance, model)
    if placement is None or not wanted(placement, shot, group_of(config, shot)[1]):
        return TickResult(True, placement.version if placement is not None else 0, False)
    staged: bool = await loop.submit(
        engine.stage_placement, placement.version, placement.physical_to_logical, model
    )
    return TickResult(True, placement.version, staged)


async def run_eplb_agent(loop: EngineLoop, redis: aioredis.Redis, config: EPLBAgentConfig) -> None:
    """Tick every `config.report_s` until cancelled or the engine loop ended; errors wait for the
    next tick."""
    while True:
        try:
            await tick(loop, redis, config)
        except Unavailable:
            return  # the engine loop ended: so does the rank
        except (RedisError, OSError) as e:
            log.warning(
                "eplb: redis unavailable, retrying",
                instance=config.instance,
                rank=config.rank,
                error=f"{type(e).__name__}: {e}",
            )
        except ValueError as e:  # a malformed placement or report: skip it, keep serving
            log.warning(
                "eplb: placement rejected", instance=config.instance, rank=config.rank, error=str(e)
            )
        await pause(config.report_s)
