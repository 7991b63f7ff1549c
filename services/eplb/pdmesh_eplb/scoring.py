"""Scoring placements: balancedness (mean rank load / max rank load per MoE layer), moved slots,
and the input checks every planner entry point shares. Pure numpy.

Legend: L layers, E logical experts, P = E + S physical slots, R ranks, C = P / R slots per rank.
"""

from __future__ import annotations

import numpy as np


def _check_loads(loads: np.ndarray) -> np.ndarray:
    """Loads as float64 [L, E]; ValueError for another shape, NaN/inf or negatives."""
    w = np.asarray(loads, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise ValueError(f"loads must be a non-empty [L, E] array, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("loads contain NaN or inf")
    if (w < 0).any():
        raise ValueError("loads must be non-negative")
    return w


def _check_layout(num_experts: int, num_ranks: int, num_redundant: int, num_nodes: int) -> None:
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    if num_redundant < 0:
        raise ValueError(f"num_redundant must be >= 0, got {num_redundant}")
    num_slots = num_experts + num_redundant
    if num_slots % num_ranks:
        raise ValueError(
            f"{num_experts} experts + {num_redundant} redundant slots = {num_slots} "
            f"slots, not divisible by {num_ranks} ranks"
        )
    if num_slots // num_ranks > num_experts:  # some expert would need more than R replicas
        raise ValueError(
            f"{num_slots // num_ranks} slots per rank but {num_experts} experts: "
            f"replicas would share a rank (an expert can have at most {num_ranks} "
            f"replicas)"
        )
    if num_nodes <= 0 or num_ranks % num_nodes:
        raise ValueError(f"{num_ranks} ranks cannot be split evenly into {num_nodes} nodes")


def _check_previous(
    previous: np.ndarray, shape: tuple[int, int], num_experts: int, moe: np.ndarray
) -> np.ndarray:
    """`previous` as int64 [L, P], holding every expert in each MoE layer."""
    prev = np.asarray(previous)
    if prev.shape != shape:
        raise ValueError(f"previous plan has shape {prev.shape}, expected [L, P] = {shape}")
    if not np.issubdtype(prev.dtype, np.integer):
        raise ValueError(f"previous plan must hold integer expert ids, got dtype {prev.dtype}")
    prev = prev.astype(np.int64)
    if prev.min() < 0 or prev.max() >= num_experts:
        raise ValueError(f"previous plan holds expert ids outside [0, {num_experts})")
    held = np.zeros((shape[0], num_experts), dtype=bool)
    np.put_along_axis(held, prev, True, axis=1)
    if not held[moe].all():
        raise ValueError("previous plan leaves some expert without a slot in a MoE layer")
    return prev


def _identity(shape: tuple[int, int], num_redundant: int) -> np.ndarray:
    """The engine's initial layout [L, P]: slot s holds expert s % E (no co-location if C <= E)."""
    num_layers, num_experts = shape
    return np.tile(np.arange(num_experts + num_redundant) % num_experts, (num_layers, 1))


def _balancedness(w: np.ndarray, p2l: np.ndarray, num_ranks: int) -> np.ndarray:
    """`balancedness` without input checks: w [L, E] float, p2l [L, P] int."""
    rows = np.arange(len(w))[:, None]
    counts = np.zeros(w.shape, dtype=np.int64)
    np.add.at(counts, (rows, p2l), 1)
    rank_load = (w[rows, p2l] / counts[rows, p2l]).reshape(len(w), num_ranks, -1).sum(2)
    peak = rank_load.max(1)
    out: np.ndarray = np.divide(rank_load.mean(1), peak, out=np.ones(len(w)), where=peak > 0)
    return out


def balancedness(loads: np.ndarray, p2l: np.ndarray, num_ranks: int) -> np.ndarray:
    """Per layer [L]: mean rank load / max rank load, an expert's load split evenly over its
    replicas (1.0 = perfect; 1.0 for all-zero layers). loads [L, E], p2l [L, P]."""
    w = _check_loads(loads)
    p2l = np.asarray(p2l, dtype=np.int64)
    if p2l.ndim != 2 or p2l.shape[0] != len(w) or p2l.shape[1] % num_ranks:
        raise ValueError(
            f"plan shape {p2l.shape} does not fit loads {w.shape} and {num_ranks} ranks"
        )
    return _balancedness(w, p2l, num_ranks)


def window_balancedness(loads: np.ndarray, p2l: np.ndarray, num_ranks: int) -> float:
    """Mean of `balancedness` over MoE (non-zero) layers; 1.0 when there are none."""
    moe = np.asarray(loads).sum(1) > 0
    return float(balancedness(loads, p2l, num_ranks)[moe].mean()) if moe.any() else 1.0


def moved_slots_per_layer(previous: np.ndarray, new: np.ndarray) -> np.ndarray:
    """[L]: slots whose logical expert differs between two [L, P] plans."""
    a, b = np.asarray(previous), np.asarray(new)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"plans of different shapes: {a.shape} vs {b.shape}")
    out: np.ndarray = (a != b).sum(1)
    return out


def moved_slots(previous: np.ndarray, new: np.ndarray, loads: np.ndarray | None = None) -> int:
    """Slots whose logical expert changed, over the MoE layers of `loads` (all layers if None)."""
    per_layer = moved_slots_per_layer(previous, new)
    if loads is not None:
        per_layer = per_layer[np.asarray(loads).sum(1) > 0]
    return int(per_layer.sum())


def moved_fraction(previous: np.ndarray, new: np.ndarray, loads: np.ndarray | None = None) -> float:
    """`moved_slots` / (counted layers x P); 0.0 when no layer counts."""
    shape = np.asarray(previous).shape
    layers = shape[0] if loads is None else int((np.asarray(loads).sum(1) > 0).sum())
    return moved_slots(previous, new, loads) / (layers * shape[1]) if layers else 0.0


# ---------------------------------------------------------------------------------- construction
