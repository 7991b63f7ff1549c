"""The MoE figures of `pdmesh bench costs` from what one engine recorded (see `pdmesh_bench.costs`).

balancedness_of(rows, R)  rows [S][L][P]: tokens per slot of S decode steps of one rank, whose
                          slot s holds expert s (a single rank's initial placement). Per step
                          and MoE layer: mean / max rank load with the E experts split over R
                          ranks, `none` as the engine's initial placement (contiguous E / R
                          slots per rank), `eplb` as `pdmesh_eplb.planner.plan(loads of all S
                          steps, R, 0 redundant)` places them; means over layers and steps.
moe_fallback(engine, B)   where the MoE modules run inside one C call (DeepSeek-V3's CPU layer
                          path) no module hook sees them: the MoE share of the bytes a decode
                          step of B tokens reads (`pdmesh_bench.machine.DecodeCostModel`, a
                          memory-bound step's share), else 0 with a note.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pdmesh_engine.engine_core import EngineCore

NOT_MEASURED = {"eplb": 1.0, "none": 1.0}


def balancedness_of(rows: list[Any], num_ranks: int) -> tuple[dict[str, float], str]:
    """({"eplb", "none"}, a note); 1.0 both with the reason where it cannot be measured."""
    from pdmesh_eplb.planner import plan
    from pdmesh_eplb.scoring import balancedness

    if not rows:
        return dict(NOT_MEASURED), "1.0 both: no routed experts (or no step recorded)"
    counts = np.asarray(rows, dtype=np.float64)  # [S, L, P]
    num_layers, num_experts = counts.shape[1:]
    if num_experts % num_ranks:
        return dict(NOT_MEASURED), f"1.0 both: {num_experts} experts do not split over {num_ranks}"
    moe = counts.sum(axis=(0, 2)) > 0  # layers with routed experts
    identity = np.tile(np.arange(num_experts), (num_layers, 1))
    planned = plan(counts.sum(axis=0), num_ranks, 0).physical_to_logical

    def mean_over_steps(p2l: np.ndarray) -> float:
        return float(np.mean([balancedness(step, p2l, num_ranks)[moe].mean() for step in counts]))

    result = {"eplb": mean_over_steps(planned), "none": mean_over_steps(identity)}
    tokens = counts[0, np.argmax(moe)].sum()
    note = (
        f"{len(counts)} decode steps ({tokens:.0f} expert picks per MoE layer a step), "
        f"{int(moe.sum())} MoE layers, experts over {num_ranks} ranks; eplb fitted in-sample"
    )
    return result, note


def moe_fallback(engine: EngineCore, batch: int) -> tuple[float, str]:
    """(share, how) where no module hook saw the MoE layers."""
    from pdmesh_bench.machine import DecodeCostModel
    from pdmesh_engine.model.deepseek_v3.runtime import V3Family

    runner = engine.runner
    if not isinstance(runner.family, V3Family):
        return 0.0, "not measured: no MoE module ran in Python (share left 0)"
    cost = DecodeCostModel.from_model(runner.model, runner.kv_layout.bytes_per_token)
    contexts = [32] * batch
    moe = cost.num_moe_layers * cost.experts_used(batch) * cost.params_per_expert
    share = moe * cost.bytes_per_param / cost.bytes(contexts)
    return share, (
        f"estimated, not timed: the C layer path runs the MoE layers, so the share of the bytes a "
        f"decode step of {batch} tokens reads (routed experts / all, DecodeCostModel)"
    )
