"""Expert-placement planner (EPLB): which logical expert each physical slot holds, per MoE layer.

Every MoE layer has P = E + S physical slots spread evenly over R ranks (slot s lives on rank
s // C). A token goes to one replica of its expert chosen at random, so an expert's load splits
evenly over its replicas; the planner picks replica counts and slot positions that even out the
rank loads. Pure numpy, vectorised over layers (Python loops run over greedy steps only).

Contracts of every plan `plan()` returns:
  * [L, P] int64, values in [0, E); every expert holds >= 1 slot in every layer;
  * no rank holds two replicas of one expert (no co-location), in any layer;
  * a dense layer (its load row is all zeros) is the identity: slot s holds expert s % E;
  * with `previous`: at most floor(move_budget * P) slots differ from it per MoE layer, beyond
    those that must change to undo co-location in `previous`.

Modules: `scoring` (balancedness, moved slots, input checks) ← `search` (replica counts, packing,
local search) ← this module (the `Plan` type, `plan`, the baseline, JSON files and the CLI).

`plan_from_scratch` is the comparison baseline in the style of DeepSeek's public greedy EPLB; it
may co-locate replicas, as the original does.

Legend: L layers, M MoE (non-zero) layers, E logical experts, S redundant slots, P = E + S slots,
R ranks, C = P / R slots per rank, N nodes (R / N consecutive ranks each), n active layers,
T hot ranks and K partner ranks examined per step.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdmesh_eplb.scoring import (
    _balancedness,
    _check_layout,
    _check_loads,
    _check_previous,
    _identity,
    balancedness,
    moved_fraction,
    moved_slots,
    moved_slots_per_layer,
    window_balancedness,
)
from pdmesh_eplb.search import (
    _NODE_SLACK,
    _fit_counts,
    _pack,
    _pairing_bound,
    _refine,
    _repair,
    _replica_counts,
    _Search,
)

__all__ = [
    "Plan",
    "balancedness",
    "load_loads",
    "load_plan",
    "main",
    "moved_fraction",
    "moved_slots",
    "moved_slots_per_layer",
    "plan",
    "plan_from_scratch",
    "save_plan",
    "window_balancedness",
]


@dataclass(frozen=True, eq=False)
class Plan:
    """`physical_to_logical[l, s]`: the logical expert slot s of layer l holds.

    Invariants (checked): [L, P] int64 (a read-only copy), ids >= 0, P % num_ranks == 0.
    Co-location is not rejected here (the baseline may produce it); `plan()` never produces it.
    """

    physical_to_logical: np.ndarray  # [L, P] int64
    num_ranks: int

    def __post_init__(self) -> None:
        p2l = np.array(self.physical_to_logical, dtype=np.int64, copy=True)
        if p2l.ndim != 2 or p2l.shape[1] == 0:
            raise ValueError(
                f"physical_to_logical must be a non-empty [L, P] array, got shape {p2l.shape}"
            )
        if self.num_ranks <= 0 or p2l.shape[1] % self.num_ranks:
            raise ValueError(
                f"{p2l.shape[1]} slots cannot be split evenly over {self.num_ranks} ranks"
            )
        if p2l.size and p2l.min() < 0:
            raise ValueError("physical_to_logical holds a negative expert id")
        p2l.setflags(write=False)
        object.__setattr__(self, "physical_to_logical", p2l)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Plan)
            and self.num_ranks == other.num_ranks
            and np.array_equal(self.physical_to_logical, other.physical_to_logical)
        )

    __hash__ = None  # type: ignore[assignment]  # holds an array

    @property
    def num_layers(self) -> int:
        return int(self.physical_to_logical.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.physical_to_logical.shape[1])

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    def to_json(self) -> dict[str, Any]:
        """{"num_ranks": R, "num_slots": P, "physical_to_logical": [[int] * P] * L}."""
        return {
            "num_ranks": self.num_ranks,
            "num_slots": self.num_slots,
            "physical_to_logical": self.physical_to_logical.tolist(),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        """Inverse of `to_json` (num_slots may be left out); ValueError for a missing key or
        a num_slots that disagrees with the rows."""
        try:
            p2l = np.asarray(d["physical_to_logical"], dtype=np.int64)
            num_ranks = int(d["num_ranks"])
            num_slots = int(d["num_slots"]) if "num_slots" in d else p2l.shape[-1]
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"not a plan: {exc!r}") from exc
        if p2l.ndim != 2 or p2l.shape[1] != num_slots:
            raise ValueError(f"num_slots={num_slots} but physical_to_logical has shape {p2l.shape}")
        return cls(p2l, num_ranks)


# ------------------------------------------------------------------------------ checks, measures


def _search_from(w: np.ndarray, counts: np.ndarray, num_ranks: int, num_nodes: int) -> np.ndarray:
    """p2l [M, P]: these replica counts packed greedily, then refined."""
    p2l = _pack(w, counts, num_ranks, avoid_colocation=True, num_nodes=num_nodes)
    return _refine(_Search(w, _repair(w, p2l, num_ranks), num_ranks, num_nodes))


def _from_scratch(w: np.ndarray, num_ranks: int, num_slots: int, num_nodes: int) -> np.ndarray:
    """p2l [M, P] from scratch: min-max replica counts, packing, local search. Layers whose
    min-max counts provably cannot reach the mean (`_pairing_bound`) also try `_fit_counts` and
    keep the better; a layer no better than the identity layout takes the identity."""
    counts = _replica_counts(w, num_slots, num_ranks)
    out = _search_from(w, counts, num_ranks, num_nodes)
    skewed = np.flatnonzero(_pairing_bound(w, counts, num_ranks) > 1.01 * w.sum(1) / num_ranks)
    if skewed.size:
        alt_counts, fits = _fit_counts(w[skewed], num_slots, num_ranks)
        if fits.any():
            rows = skewed[fits]
            alt = _search_from(w[rows], alt_counts[fits], num_ranks, num_nodes)
            better = _balancedness(w[rows], alt, num_ranks) > _balancedness(
                w[rows], out[rows], num_ranks
            )
            out[rows[better]] = alt[better]
    ident = _identity(w.shape, num_slots - w.shape[1])  # ties go to the engine's default
    worse = _balancedness(w, out, num_ranks) <= _balancedness(w, ident, num_ranks) + 1e-12
    out[worse] = ident[worse]
    return out


def _plan_moe(
    w: np.ndarray,
    num_ranks: int,
    num_slots: int,
    num_nodes: int,
    previous: np.ndarray | None,
    budget: int,
    min_gain: float,
) -> np.ndarray:
    """p2l [M, P] for MoE rows w [M, E] (every row has a positive total)."""
    ident = _identity(w.shape, num_slots - w.shape[1])
    if previous is not None:  # undoing co-location is mandatory and counts against the budget
        st = _Search(w, _repair(w, previous, num_ranks), num_ranks, num_nodes)
        out = _refine(st, previous, budget, min_gain)
        # The identity layout, when within the budget of `previous` and better, is a candidate too.
        take = ((ident != previous).sum(1) <= budget) & (
            _balancedness(w, ident, num_ranks) > _balancedness(w, out, num_ranks)
        )
        out[take] = ident[take]
        return out
    out = _from_scratch(w, num_ranks, num_slots, num_nodes)
    if num_nodes > 1:  # locality must not cost balance: a layer that might trail the flat plan
        rows = np.flatnonzero(_balancedness(w, out, num_ranks) < 1.0 - _NODE_SLACK)
        if rows.size:  # by more than _NODE_SLACK is compared with it and may take it instead
            flat = _from_scratch(w[rows], num_ranks, num_slots, 1)
            worse = (
                _balancedness(w[rows], out[rows], num_ranks)
                < _balancedness(w[rows], flat, num_ranks) - _NODE_SLACK
            )
            out[rows[worse]] = flat[worse]
    return out


def plan(
    loads: np.ndarray,
    num_ranks: int,
    num_redundant: int,
    *,
    num_nodes: int = 1,
    previous: np.ndarray | Plan | None = None,
    move_budget: float = 0.2,
    min_gain: float = 0.0,
) -> Plan:
    """Places E experts on P = E + S slots over R ranks for every layer of loads [L, E].

    previous=None: from scratch (replica counts minimising the heaviest replica, or for heavy
    skew splitting experts only as far as needed; greedy packing without co-location; then a
    swap / re-replicate local search).
    previous [L, P] int (or a Plan): move-minimising. Starts from it (co-location in it is undone
    first), then greedy moves on the hottest rank: swap a slot with a cooler rank, or
    re-replicate (a replica of a colder replicated expert becomes another replica of a hot one),
    ranked by gain per rewritten slot. A layer stops when no move lowers its peak by
    max(min_gain x peak, 1e-4 x mean) per rewritten slot, or before more than
    floor(move_budget * P) of its slots would differ from `previous`; moves after its last
    strict improvement are dropped (and the identity layout is taken where it is within that
    budget and better).
    num_nodes N > 1: the packing keeps an expert's later replicas on its first replica's node
    when a rank there is nearly as cool, and moves pay a small price per extra node an expert
    spans; from scratch, a layer whose balancedness would trail the flat (N = 1) plan's by more
    than 0.002 takes the flat layer. Node loads are sums of rank loads, so node balancedness >=
    rank balancedness.
    ValueError: loads not [L, E], negative or non-finite; S < 0; P % R != 0; P / R > E; R % N;
    previous of another shape, non-integer, out of range or missing an expert in a MoE layer;
    move_budget outside [0, 1]; min_gain < 0.
    """
    w = _check_loads(loads)
    _check_layout(w.shape[1], num_ranks, num_redundant, num_nodes)
    if not 0.0 <= move_budget <= 1.0:
        raise ValueError(f"move_budget must be a fraction in [0, 1], got {move_budget}")
    if not min_gain >= 0.0:
        raise ValueError(f"min_gain must be >= 0, got {min_gain}")
    out = _identity(w.shape, num_redundant)
    moe = w.sum(1) > 0
    if isinstance(previous, Plan):
        previous = previous.physical_to_logical
    prev = None if previous is None else _check_previous(previous, out.shape, w.shape[1], moe)
    if moe.any():
        budget = int(np.floor(move_budget * out.shape[1] + 1e-9))
        out[moe] = _plan_moe(
            w[moe],
            num_ranks,
            out.shape[1],
            num_nodes,
            None if prev is None else prev[moe],
            budget,
            min_gain,
        )
    return Plan(out, num_ranks)


def plan_from_scratch(loads: np.ndarray, num_ranks: int, num_redundant: int) -> Plan:
    """Baseline in the style of DeepSeek's public greedy EPLB: each of the S extra slots goes to
    the expert with the highest load per replica (no cap), then replicas are packed
    heaviest-first, each onto the least-loaded rank with a free slot. May co-locate replicas."""
    w = _check_loads(loads)
    _check_layout(w.shape[1], num_ranks, num_redundant, 1)
    out = _identity(w.shape, num_redundant)
    moe = w.sum(1) > 0
    if moe.any():
        counts = _replica_counts(w[moe], out.shape[1], cap=out.shape[1])
        out[moe] = _pack(w[moe], counts, num_ranks, avoid_colocation=False)
    return Plan(out, num_ranks)


# ------------------------------------------------------------------------------------ files, CLI


def load_loads(path: str | Path) -> np.ndarray:
    """Reads {"logical_count": [[float] * E] * L} as float64 [L, E] (checked as `plan` does)."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or "logical_count" not in data:
        raise ValueError(f"{path}: expected a JSON object with a 'logical_count' key")
    return _check_loads(np.asarray(data["logical_count"], dtype=np.float64))


def load_plan(path: str | Path) -> Plan:
    """Reads a plan written by `save_plan` (see `Plan.to_json`)."""
    with open(path) as f:
        return Plan.from_json(json.load(f))


def save_plan(plan: Plan, path: str | Path) -> None:
    """Writes `plan.to_json()` as JSON, one layer per line."""
    d = plan.to_json()
    rows = ",\n  ".join(json.dumps(row) for row in d["physical_to_logical"])
    Path(path).write_text(
        f'{{"num_ranks": {d["num_ranks"]}, "num_slots": {d["num_slots"]}, '
        f'"physical_to_logical": [\n  {rows}\n]}}\n'
    )


def main(argv: list[str] | None = None) -> int:
    """`plan --loads LOADS.json --ranks R --redundant S [--nodes N] [--previous PLAN.json]
    [--move-budget 0.2] --out PLAN.json`: writes the plan and prints a one-line summary
    (balancedness before -> after, slots moved, plan time). 0 on success, 2 on bad input."""
    p = argparse.ArgumentParser(
        prog="pdmesh eplb plan", description="Plan expert placement (EPLB) from expert loads."
    )
    p.add_argument("--loads", required=True, help='JSON {"logical_count": [[float] * E] * L}')
    p.add_argument("--ranks", type=int, required=True, help="expert-parallel ranks R")
    p.add_argument("--redundant", type=int, required=True, help="redundant slots S per layer")
    p.add_argument("--nodes", type=int, default=1, help="nodes N (R / N ranks each)")
    p.add_argument("--previous", help="current plan JSON: rebalance from it, moving few slots")
    p.add_argument(
        "--move-budget",
        type=float,
        default=0.2,
        help="max fraction of a layer's slots rewritten (with --previous)",
    )
    p.add_argument("--out", required=True, help="where to write the plan JSON")
    args = p.parse_args(argv)
    try:
        loads = load_loads(args.loads)
        prev = load_plan(args.previous) if args.previous else None
        if prev is not None and prev.num_ranks != args.ranks:
            raise ValueError(f"previous plan is for {prev.num_ranks} ranks, not {args.ranks}")
        start = time.perf_counter()
        new = plan(
            loads,
            args.ranks,
            args.redundant,
            num_nodes=args.nodes,
            previous=None if prev is None else prev.physical_to_logical,
            move_budget=args.move_budget,
        )
        elapsed_ms = (time.perf_counter() - start) * 1e3
    except (OSError, ValueError) as exc:
        print(f"plan: error: {exc}")
        return 2
    before = (
        prev.physical_to_logical if prev is not None else _identity(loads.shape, args.redundant)
    )
    save_plan(new, args.out)
    moved = moved_slots(before, new.physical_to_logical, loads)
    print(
        f"balancedness {window_balancedness(loads, before, args.ranks):.4f} "
        f"({'previous' if prev is not None else 'identity'}) -> "
        f"{window_balancedness(loads, new.physical_to_logical, args.ranks):.4f}; "
        f"slots moved {moved} ({moved_fraction(before, new.physical_to_logical, loads):.1%}); "
        f"plan {elapsed_ms:.1f} ms; wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
