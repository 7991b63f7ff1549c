"""`pdmesh plan`: the cheapest topology (fewest ranks, i.e. GPUs) whose simulated run meets the
SLOs, the frontier of ranks vs goodput, and why (which pool binds).

Every topology within `--max-ranks` (agg: decode instances only; disagg: prefill and decode
instances, at the given DEP sizes) is simulated on the same workload and cost file. A topology
meets the SLOs when at least `--attainment` of its requests do (`slo.meets`: completed, TTFT and
TPOT within their targets). Its margin is its attainment over the target. The binding pool is read
from the topologies one instance smaller: the pool whose removal breaks the SLOs binds; when
either would, the one whose misses dominate (TTFT misses: prefill; TPOT misses: decode).
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pdmesh_bench.plots import save_figure
from pdmesh_bench.serve import ServeOptions, add_workload_arguments
from pdmesh_bench.sim.cli import add_gateway_arguments, add_slo_arguments, gateway_of
from pdmesh_bench.sim.costs import Costs, load_costs
from pdmesh_bench.sim.mesh import GatewayOptions, Topology
from pdmesh_bench.sim.slo import Slo, goodput, meets


@dataclass(frozen=True)
class Outcome:
    topology: Topology
    attainment: float
    goodput_tokens_per_s: float
    ttft_p90_ms: float | None
    tpot_p90_ms: float | None
    ttft_misses: int  # requests over the TTFT target (errors included)
    tpot_misses: int
    busy: dict[str, float]  # mean busy fraction per pool (prefill, decode)

    def meets(self, target: float) -> bool:
        return self.attainment >= target

    def row(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "topology": str(self.topology),
            "num_ranks": self.topology.num_ranks,
        }


def topologies(max_ranks: int, modes: Sequence[str], deps: Sequence[int]) -> Iterator[Topology]:
    """Every topology of at most `max_ranks` ranks (same DEP size per pool)."""
    for dd in deps:
        if "agg" in modes:
            for d in range(1, max_ranks // dd + 1):
                yield Topology(0, d, 1, dd, "agg")
        if "disagg" not in modes:
            continue
        for pd in deps:
            for p, d in itertools.product(range(1, max_ranks + 1), repeat=2):
                if p * pd + d * dd <= max_ranks:
                    yield Topology(p, d, pd, dd, "disagg")


def evaluate(
    costs: Costs, topology: Topology, gateway: GatewayOptions, workload: ServeOptions, slo: Slo
) -> Outcome:
    from pdmesh_bench.sim.simulate import simulate

    result = simulate(costs, topology, gateway, workload)
    rows = result["requests"]
    busy: dict[str, list[float]] = {"prefill": [], "decode": []}
    for name, inst in result["sim"]["instances"].items():
        busy[name.split("-")[0]].append(inst["busy_fraction"])
    missed = [r for r in rows if not meets(r, slo)]
    ttft_misses = sum(1 for r in missed if not r["ok"] or r["ttft_ms"] > slo.ttft_ms)
    return Outcome(
        topology,
        goodput(result, slo)["attainment"] or 0.0,
        goodput(result, slo)["goodput_tokens_per_s"],
        result["ttft_ms"]["p90"],
        result["tpot_ms"]["p90"],
        ttft_misses,
        len(missed) - ttft_misses,
        {k: sum(v) / len(v) for k, v in busy.items() if v},
    )


def binding_pool(best: Outcome, outcomes: dict[Topology, Outcome], target: float) -> str:
    """Why `best` is the smallest: what one instance less of each pool does."""
    t = best.topology
    smaller = {
        "prefill": replace(t, prefill=t.prefill - 1)
        if t.mode == "disagg" and t.prefill > 1
        else None,
        "decode": replace(t, decode=t.decode - 1) if t.decode > 1 else None,
    }
    reasons = []
    for pool, topology in smaller.items():
        outcome = outcomes.get(topology) if topology is not None else None
        if pool == "prefill" and t.mode == "agg":
            reasons.append("prefill: none (agg: decode prefills)")
        elif outcome is None:
            reasons.append(f"{pool}: already at its minimum")
        else:
            reasons.append(
                f"{pool}: one fewer ({topology}) attains {outcome.attainment:.0%} < {target:.0%} "
                f"({outcome.ttft_misses} TTFT misses, {outcome.tpot_misses} TPOT misses)"
            )
    if not best.ttft_misses and not best.tpot_misses:
        return "; ".join(reasons) + "; it misses none"
    dominant = "prefill (TTFT)" if best.ttft_misses >= best.tpot_misses else "decode (TPOT)"
    return "; ".join(reasons) + f"; its own misses are mostly {dominant}"


def plan(
    costs: Costs,
    workload: ServeOptions,
    slo: Slo,
    gateway: GatewayOptions,
    target: float,
    candidates: Sequence[Topology],
    progress: bool = True,
) -> dict[str, Any]:
    outcomes: dict[Topology, Outcome] = {}
    for topology in candidates:
        outcomes[topology] = evaluate(costs, topology, gateway, workload, slo)
        if progress:
            o = outcomes[topology]
            rate = o.goodput_tokens_per_s
            print(f"  {topology!s:<14} attainment {o.attainment:6.1%}  goodput {rate:8.1f}")
    meeting = [o for o in outcomes.values() if o.meets(target)]
    best = min(meeting, key=lambda o: (o.topology.num_ranks, -o.goodput_tokens_per_s), default=None)
    frontier: dict[int, Outcome] = {}
    for o in outcomes.values():
        n = o.topology.num_ranks
        if n not in frontier or o.goodput_tokens_per_s > frontier[n].goodput_tokens_per_s:
            frontier[n] = o
    return {
        "slo": asdict(slo),
        "target_attainment": target,
        "best": None if best is None else best.row(),
        "margin": None if best is None else best.attainment - target,
        "why": None if best is None else binding_pool(best, outcomes, target),
        "frontier": [frontier[n].row() for n in sorted(frontier)],
        "candidates": [o.row() for o in outcomes.values()],
    }


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("plan", help="the cheapest topology that meets SLOs, by simulation")
    p.add_argument("--costs", type=Path, required=True, help="cost file (pdmesh bench costs)")
    add_slo_arguments(p, required=True)
    p.add_argument(
        "--attainment", type=float, default=0.9, help="share of requests that must meet the SLOs"
    )
    p.add_argument("--max-ranks", type=int, default=8, help="largest topology tried (ranks/GPUs)")
    p.add_argument("--modes", default="agg,disagg", help="comma list of agg, disagg")
    p.add_argument("--deps", default="1", help="DEP sizes tried, comma list (e.g. 1,2,4)")
    add_gateway_arguments(p)
    add_workload_arguments(p)
    p.add_argument("--json", type=Path, help="write the plan (every candidate) here")
    p.add_argument("--plot", type=Path, help="PNG: the frontier (ranks vs goodput)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.trace is None and not args.synthetic:
        raise ValueError("give a workload: --trace FILE or --synthetic --rate R")
    if not 0 < args.attainment <= 1:
        raise ValueError("--attainment is a share in (0, 1]")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"agg", "disagg"}:
        raise ValueError(f"--modes takes agg and/or disagg, got {args.modes!r}")
    deps = [int(d) for d in args.deps.split(",")]
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    candidates = list(topologies(args.max_ranks, modes, deps))
    print(f"pdmesh plan: {len(candidates)} topologies of <= {args.max_ranks} ranks; SLO {slo}")
    result = plan(
        load_costs(args.costs),
        ServeOptions.from_args(args),
        slo,
        gateway_of(args),
        args.attainment,
        candidates,
    )
    print_plan(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        print(f"pdmesh plan: wrote {write_frontier_plot(args.plot, result)}")
    return 0 if result["best"] is not None else 1


def print_plan(result: dict[str, Any]) -> None:
    print(f"{'ranks':>5}  {'best topology':<14} {'attainment':>10} {'goodput tok/s':>14}")
    for row in result["frontier"]:
        print(
            f"{row['num_ranks']:>5}  {row['topology']:<14} {row['attainment']:>10.1%} "
            f"{row['goodput_tokens_per_s']:>14.1f}"
        )
    best = result["best"]
    target = result["target_attainment"]
    if best is None:
        print(f"no topology tried meets the SLOs for {target:.0%} of requests: raise --max-ranks")
        return
    print(
        f"cheapest: {best['topology']} ({best['num_ranks']} ranks): attainment "
        f"{best['attainment']:.1%} (margin {result['margin']:+.1%} over {target:.0%}), TTFT p90 "
        f"{best['ttft_p90_ms']:.0f} ms, TPOT p90 {best['tpot_p90_ms']:.1f} ms"
    )
    print(f"why: {result['why']}")


def write_frontier_plot(path: str | Path, result: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["frontier"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    xs = [r["num_ranks"] for r in rows]
    ax.plot(xs, [r["goodput_tokens_per_s"] for r in rows], "o-", label="goodput (best topology)")
    for r in rows:
        ax.annotate(r["topology"], (r["num_ranks"], r["goodput_tokens_per_s"]), fontsize=7)
    ax.set_xlabel("ranks (GPUs)")
    ax.set_ylabel("goodput (output tokens/s within the SLOs)")
    share = ax.twinx()
    share.plot(xs, [r["attainment"] for r in rows], "s--", color="tab:orange", label="attainment")
    share.axhline(result["target_attainment"], color="tab:orange", alpha=0.4)
    share.set_ylabel("share of requests within the SLOs")
    share.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    best = result["best"]
    ax.set_title(f"pdmesh plan: cheapest {best['topology'] if best else 'none'}")
    fig.legend(loc="lower right", fontsize="small")
    return save_figure(fig, path)
