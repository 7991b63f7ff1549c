"""Offline evaluation of expert placements: per-step sampling, drift chains, planner vs baseline.

The load files are window totals (no per-step series): per-step traffic is simulated by sampling
tokens from a window's expert distribution, and load drift by a multiplicative random walk.
`python -m pdmesh_eplb.simulate --loads FILES --ranks R --redundant S [--json out.json]` prints a
table (see `main`).

Legend: L layers, E logical experts, P physical slots, R ranks, T tokens per step, K experts per
token (top-k).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdmesh_eplb.planner import (
    balancedness,
    load_loads,
    moved_fraction,
    moved_slots_per_layer,
    plan,
    plan_from_scratch,
    window_balancedness,
)


def _inclusion(w: np.ndarray, top_k: int) -> np.ndarray:
    """Per-token inclusion probabilities [L, E], rows summing to K (zero rows stay zero), each
    <= 1: K x the expert's share of load, shares above 1 capped and the excess spread over the
    uncapped experts in proportion."""
    total = w.sum(1, keepdims=True)
    pi = np.divide(top_k * w, total, out=np.zeros_like(w), where=total > 0)
    for _ in range(top_k):
        if not (pi > 1.0 + 1e-12).any():
            break
        capped = pi >= 1.0
        rest = np.where(capped, 0.0, pi)
        free = top_k - capped.sum(1, keepdims=True)
        mass = rest.sum(1, keepdims=True)
        pi = np.where(
            capped, 1.0, rest * np.divide(free, mass, out=np.zeros_like(mass), where=mass > 0)
        )
    out: np.ndarray = np.minimum(pi, 1.0)
    return out


def sample_step_loads(
    window_loads: np.ndarray, tokens_per_step: int, top_k: int, rng: np.random.Generator
) -> np.ndarray:
    """Expert loads [L, E] of one step of T tokens, each picking K distinct experts.

    Vectorised approximation, systematic sampling: the inclusion probabilities pi (K x load
    share, capped at 1, see `_inclusion`) are laid end to end in an order drawn at random per
    step and layer, and a token takes the experts whose intervals hold u, u + 1, ..., u + K - 1
    for its own uniform u. Each token gets exactly K distinct experts and picks expert e with
    probability pi_e independently of the other tokens (so counts are Binomial(T, pi_e)); only
    the co-occurrence of experts within one token differs from a real router's. All-zero (dense)
    rows stay zero."""
    w = np.asarray(window_loads, dtype=np.float64)
    num_layers, num_experts = w.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    moe = w.sum(1) > 0
    pi = _inclusion(w[moe], top_k)  # [M, E]
    num_moe = len(pi)
    offset = (np.arange(num_moe) * (top_k + 1.0))[:, None]  # keeps the layers' ranges apart
    order = np.argsort(rng.random(pi.shape), axis=1)
    bounds = np.cumsum(np.take_along_axis(pi, order, 1), axis=1)
    bounds[:, -1] = top_k + 0.5  # absorbs float round-off
    bounds += offset
    u = rng.random((num_moe, tokens_per_step, 1)) + np.arange(top_k) + offset[:, :, None]
    pos = np.searchsorted(bounds.ravel(), u.ravel(), side="right")  # [M * T * K] global index
    picked = order.ravel()[pos] + pos // num_experts * num_experts
    out = np.zeros((num_layers, num_experts))
    out[moe] = np.bincount(picked, minlength=num_moe * num_experts).reshape(num_moe, num_experts)
    return out


def per_step_balancedness(
    step_loads: np.ndarray, p2l: np.ndarray, num_ranks: int, rng: np.random.Generator
) -> np.ndarray:
    """Per layer [L]: mean / max rank load of one step, each token of an expert sent to one of
    its replicas chosen uniformly at random (a multinomial split of the expert's count); 1.0 for
    layers without tokens. step_loads [L, E] integer counts, p2l [L, P]."""
    tokens = np.rint(np.asarray(step_loads)).astype(np.int64)
    p2l = np.asarray(p2l, dtype=np.int64)
    num_layers, num_slots = p2l.shape
    rows = np.arange(num_layers)[:, None]
    replicas = np.zeros(tokens.shape, dtype=np.int64)
    np.add.at(replicas, (rows, p2l), 1)
    width = int(replicas.max())
    # nth [L, P]: index of each slot among its expert's replicas, in slot order
    order = np.argsort(p2l, axis=1, kind="stable")
    idx = np.broadcast_to(np.arange(num_slots), p2l.shape)
    starts = np.where(np.diff(p2l[rows, order], axis=1, prepend=-1) != 0, idx, 0)
    nth = np.empty_like(p2l)
    nth[rows, order] = idx - np.maximum.accumulate(starts, axis=1)
    pvals = (np.arange(width) < replicas[:, :, None]) / np.maximum(replicas, 1)[:, :, None]
    pvals[replicas == 0, 0] = 1.0  # experts without a slot: tokens dropped
    split = rng.multinomial(tokens, pvals)  # [L, E, width]
    rank_load = split[rows, p2l, nth].reshape(num_layers, num_ranks, -1).sum(2)
    peak = rank_load.max(1)
    out: np.ndarray = np.divide(rank_load.mean(1), peak, out=np.ones(num_layers), where=peak > 0)
    return out


def uniform_reference(
    p2l: np.ndarray,
    num_ranks: int,
    tokens_per_step: int,
    top_k: int,
    rng: np.random.Generator,
    num_steps: int = 4,
) -> np.ndarray:
    """Per layer [L]: `per_step_balancedness` averaged over num_steps steps in which every token
    picks K distinct experts uniformly at random. On the identity placement of E slots (E % R ==
    0) every rank expects the same load, so this is the sampling-noise floor: what a perfect
    balancer could reach at this step size."""
    p2l = np.asarray(p2l, dtype=np.int64)
    uniform = np.ones((p2l.shape[0], int(p2l.max()) + 1))
    runs = [
        per_step_balancedness(
            sample_step_loads(uniform, tokens_per_step, top_k, rng), p2l, num_ranks, rng
        )
        for _ in range(num_steps)
    ]
    out: np.ndarray = np.mean(runs, axis=0)
    return out


def drift_chain(
    loads: np.ndarray, steps: int, noise: float = 0.2, rng: np.random.Generator | None = None
) -> np.ndarray:
    """Windows [steps + 1, L, E]: window 0 is `loads`; each next window multiplies every expert's
    load by an independent factor uniform in [1 - noise, 1 + noise] (so drift accumulates: a
    random walk) and rescales each row to keep its total. Dense (all-zero) rows stay zero."""
    if not 0.0 <= noise < 1.0:
        raise ValueError(f"noise must be in [0, 1), got {noise}")
    rng = np.random.default_rng() if rng is None else rng
    w = np.asarray(loads, dtype=np.float64)
    chain = [w]
    for _ in range(steps):
        nxt = chain[-1] * rng.uniform(1.0 - noise, 1.0 + noise, size=w.shape)
        total = nxt.sum(1, keepdims=True)
        chain.append(
            np.divide(nxt * w.sum(1, keepdims=True), total, out=np.zeros_like(nxt), where=total > 0)
        )
    return np.stack(chain)


def colocated_replicas(p2l: np.ndarray, num_ranks: int) -> int:
    """Replicas sharing a rank with another replica of the same expert (extra copies), summed."""
    p2l = np.asarray(p2l, dtype=np.int64)
    per_rank = np.sort(p2l.reshape(p2l.shape[0], num_ranks, -1), axis=2)
    return int((per_rank[:, :, 1:] == per_rank[:, :, :-1]).sum())


def node_spread(p2l: np.ndarray, num_nodes: int, loads: np.ndarray | None = None) -> float:
    """Mean number of nodes the replicas of a replicated expert span (MoE layers of `loads`)."""
    p2l = np.asarray(p2l, dtype=np.int64)
    if loads is not None:
        p2l = p2l[np.asarray(loads).sum(1) > 0]
    num_layers, num_slots = p2l.shape
    rows = np.arange(num_layers)[:, None]
    on = np.zeros((num_layers, int(p2l.max(initial=0)) + 1, num_nodes), dtype=bool)
    on[rows, p2l, np.arange(num_slots) // (num_slots // num_nodes)] = True
    replicas = np.zeros(on.shape[:2], dtype=np.int64)
    np.add.at(replicas, (rows, p2l), 1)
    spans = on.sum(2)[replicas > 1]
    return float(spans.mean()) if spans.size else 1.0


def _timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, (time.perf_counter() - start) * 1e3


def _drift_report(
    loads: np.ndarray,
    num_ranks: int,
    num_redundant: int,
    num_nodes: int,
    steps: int,
    noise: float,
    move_budget: float,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """`steps` rebalances along a drift chain: ours from its previous plan, the baseline and ours
    from scratch; a plan fitted on window t is also scored on window t + 1 ("following")."""
    chain = drift_chain(loads, steps + 1, noise, rng)
    moe = loads.sum(1) > 0
    ours = plan(chain[0], num_ranks, num_redundant, num_nodes=num_nodes).physical_to_logical
    base = plan_from_scratch(chain[0], num_ranks, num_redundant).physical_to_logical
    rounds, times = [], []
    for t in range(1, steps + 1):
        new_plan, ms = _timed(
            plan,
            chain[t],
            num_ranks,
            num_redundant,
            num_nodes=num_nodes,
            previous=ours,
            move_budget=move_budget,
        )
        new, nxt = new_plan.physical_to_logical, chain[t + 1]
        new_base = plan_from_scratch(chain[t], num_ranks, num_redundant).physical_to_logical
        fresh = plan(chain[t], num_ranks, num_redundant, num_nodes=num_nodes).physical_to_logical
        times.append(ms)
        rounds.append(
            {
                "moved_ours": moved_fraction(ours, new, loads),
                "moved_ours_max_layer": float(
                    moved_slots_per_layer(ours, new)[moe].max() / new.shape[1]
                ),
                "moved_baseline": moved_fraction(base, new_base, loads),
                "window_ours": window_balancedness(chain[t], new, num_ranks),
                "window_scratch": window_balancedness(chain[t], fresh, num_ranks),
                "window_stale": window_balancedness(chain[t], ours, num_ranks),
                "following_ours": window_balancedness(nxt, new, num_ranks),
                "following_scratch": window_balancedness(nxt, fresh, num_ranks),
                "following_baseline": window_balancedness(nxt, new_base, num_ranks),
                "colocated_ours": colocated_replicas(new, num_ranks),
            }
        )
        ours, base = new, new_base
    return {"rounds": rounds, "plan_ms_previous": times}


def _per_step_report(
    loads: np.ndarray,
    plans: dict[str, np.ndarray],
    num_ranks: int,
    tokens_per_step: int,
    top_k: int,
    num_steps: int,
    rng: np.random.Generator,
) -> dict[str, float]:
    """Per-step balancedness averaged over MoE layers and num_steps sampled steps, per plan; plus
    `uniform_reference` on the identity placement of E slots when E % R == 0."""
    moe = loads.sum(1) > 0
    scores: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(num_steps):
        step = sample_step_loads(loads, tokens_per_step, top_k, rng)
        for name, p2l in plans.items():
            scores[name].append(float(per_step_balancedness(step, p2l, num_ranks, rng)[moe].mean()))
    out = {name: float(np.mean(v)) for name, v in scores.items()}
    num_experts = loads.shape[1]
    if num_experts % num_ranks == 0:
        ident = np.tile(np.arange(num_experts), (int(moe.sum()), 1))
        out["uniform_reference"] = float(
            uniform_reference(ident, num_ranks, tokens_per_step, top_k, rng, num_steps).mean()
        )
    return out


def evaluate(
    files_or_arrays: Sequence[str | Path | np.ndarray],
    num_ranks: int,
    num_redundant: int,
    *,
    num_nodes: int = 1,
    steps: int = 5,
    noise: float = 0.2,
    move_budget: float = 0.2,
    tokens_per_step: int = 4096,
    top_k: int = 8,
    num_step_samples: int = 4,
    seed: int = 0,
) -> dict[str, Any]:
    """Per input (loads JSON path or [L, E] array): window balancedness of ours, the baseline and
    the identity layout (mean and worst MoE layer); co-located replicas; node spread (N > 1);
    plan times; a drift chain of `steps` rebalances (`_drift_report`); per-step balancedness
    with sampled tokens (`_per_step_report`). Returns JSON-able {"config", "results"}."""
    rng = np.random.default_rng(seed)
    results = []
    for i, item in enumerate(files_or_arrays):
        if isinstance(item, (str, Path)):
            name, loads = Path(item).name, load_loads(item)
        else:
            name, loads = f"array{i}", np.asarray(item, dtype=np.float64)
        ours, ms_ours = _timed(plan, loads, num_ranks, num_redundant, num_nodes=num_nodes)
        base, ms_base = _timed(plan_from_scratch, loads, num_ranks, num_redundant)
        num_experts = loads.shape[1]
        ident = np.tile(np.arange(num_experts + num_redundant) % num_experts, (len(loads), 1))
        plans = {
            "ours": ours.physical_to_logical,
            "baseline": base.physical_to_logical,
            "identity": ident,
        }
        moe = loads.sum(1) > 0
        results.append(
            {
                "name": name,
                "window": {k: window_balancedness(loads, v, num_ranks) for k, v in plans.items()},
                "window_min_layer": {
                    k: float(balancedness(loads, v, num_ranks)[moe].min(initial=1.0))
                    for k, v in plans.items()
                },
                "colocated": {
                    k: colocated_replicas(plans[k], num_ranks) for k in ("ours", "baseline")
                },
                "node_spread": (
                    {k: node_spread(plans[k], num_nodes, loads) for k in ("ours", "baseline")}
                    if num_nodes > 1
                    else None
                ),
                "plan_ms": {"ours_scratch": ms_ours, "baseline": ms_base},
                "drift": _drift_report(
                    loads, num_ranks, num_redundant, num_nodes, steps, noise, move_budget, rng
                ),
                "per_step": (
                    _per_step_report(
                        loads, plans, num_ranks, tokens_per_step, top_k, num_step_samples, rng
                    )
                    if num_step_samples > 0
                    else None
                ),
            }
        )
    config = {
        "num_ranks": num_ranks,
        "num_redundant": num_redundant,
        "num_nodes": num_nodes,
        "steps": steps,
        "noise": noise,
        "move_budget": move_budget,
        "tokens_per_step": tokens_per_step,
        "top_k": top_k,
        "seed": seed,
    }
    return {"config": config, "results": results}


# (header, width, cell text from: a result, the mean over its rebalances of a key, its per_step)
_Cell = Callable[[dict[str, Any], Callable[[str], float], dict[str, float]], str]
_COLUMNS: list[tuple[str, int, _Cell]] = [
    ("loads", 26, lambda r, d, s: r["name"][:26]),
    ("win ours", 8, lambda r, d, s: f"{r['window']['ours']:.4f}"),
    ("win base", 8, lambda r, d, s: f"{r['window']['baseline']:.4f}"),
    ("coloc o/b", 9, lambda r, d, s: f"{r['colocated']['ours']}/{r['colocated']['baseline']}"),
    ("moved ours", 10, lambda r, d, s: f"{d('moved_ours'):.1%}"),
    ("moved base", 10, lambda r, d, s: f"{d('moved_baseline'):.1%}"),
    ("next ours", 9, lambda r, d, s: f"{d('following_ours'):.4f}"),
    ("next fresh", 10, lambda r, d, s: f"{d('following_scratch'):.4f}"),
    ("next base", 9, lambda r, d, s: f"{d('following_baseline'):.4f}"),
    ("step ours", 9, lambda r, d, s: f"{s.get('ours', float('nan')):.4f}"),
    ("step base", 9, lambda r, d, s: f"{s.get('baseline', float('nan')):.4f}"),
    ("step unif", 9, lambda r, d, s: f"{s.get('uniform_reference', float('nan')):.4f}"),
    ("ms scratch", 10, lambda r, d, s: f"{r['plan_ms']['ours_scratch']:.1f}"),
    ("ms prev", 7, lambda r, d, s: f"{np.median(r['drift']['plan_ms_previous'] or [np.nan]):.1f}"),
]


def format_table(report: dict[str, Any]) -> str:
    """`evaluate`'s report as a table, one line per input; drift columns are means over the
    rebalances ("next": balancedness on the window after the one the plan was fitted on)."""
    widths = [w for _, w, _ in _COLUMNS]

    def row(cells: list[str]) -> str:  # first column left-aligned, the others right-aligned
        return " ".join(
            f"{c:{'<' if i == 0 else '>'}{width}}"
            for i, (c, width) in enumerate(zip(cells, widths, strict=True))
        )

    lines = [row([h for h, _, _ in _COLUMNS])]
    lines.append("-" * len(lines[0]))
    for r in report["results"]:
        rounds = r["drift"]["rounds"]

        def drift_mean(key: str, rounds: list[dict[str, Any]] = rounds) -> float:
            return float(np.mean([x[key] for x in rounds])) if rounds else float("nan")

        lines.append(row([fn(r, drift_mean, r["per_step"] or {}) for _, _, fn in _COLUMNS]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m pdmesh_eplb.simulate --loads FILES --ranks R --redundant S [--json OUT]`."""
    p = argparse.ArgumentParser(
        prog="python -m pdmesh_eplb.simulate",
        description="Evaluate EPLB plans on expert-load files.",
    )
    p.add_argument(
        "--loads", nargs="+", required=True, help='JSON files {"logical_count": [[float] * E] * L}'
    )
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--redundant", type=int, required=True)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="rebalances along the drift chain")
    p.add_argument("--noise", type=float, default=0.2, help="drift per window, +- fraction")
    p.add_argument("--move-budget", type=float, default=0.2)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per sampled step, all ranks")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--step-samples", type=int, default=4, help="sampled steps (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the full report here")
    args = p.parse_args(argv)
    try:
        report = evaluate(
            args.loads,
            args.ranks,
            args.redundant,
            num_nodes=args.nodes,
            steps=args.steps,
            noise=args.noise,
            move_budget=args.move_budget,
            tokens_per_step=args.tokens,
            top_k=args.top_k,
            num_step_samples=args.step_samples,
            seed=args.seed,
        )
    except (OSError, ValueError) as exc:
        print(f"simulate: error: {exc}")
        return 2
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
