"""Parallelism of a DEP instance (data-parallel attention + expert parallelism) across rank
processes.

`allreduce`: the per-step DP sync (`DPSync`, `make_dp_sync`) and a recursive-doubling all-reduce on
torch.distributed point-to-point, whose pure schedule (`recursive_doubling_schedule`) is testable
alone.

`elastic` (with `membership`): a DEP group that survives a lost rank (re-formed over the survivors,
experts re-split) and grows back when it returns.
"""

from __future__ import annotations

from pdmesh_engine.parallel.allreduce import (
    DP_SYNC_IMPLS,
    OPS,
    AllToAllReduce,
    DPSync,
    GlooAllReduce,
    RecursiveDoublingAllReduce,
    Step,
    make_dp_sync,
    num_rounds,
    recursive_doubling_all_reduce,
    recursive_doubling_schedule,
)

__all__ = [
    "DP_SYNC_IMPLS",
    "OPS",
    "AllToAllReduce",
    "DPSync",
    "GlooAllReduce",
    "RecursiveDoublingAllReduce",
    "Step",
    "make_dp_sync",
    "num_rounds",
    "recursive_doubling_all_reduce",
    "recursive_doubling_schedule",
]
