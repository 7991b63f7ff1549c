"""`pdmesh bench rack --costs FILE [--json OUT] [--plot PNG]`: the rack-scale projection of a GPU
rack's cost file (`sim/examples/gb300-v4-flash.json`) by simulation, beside published figures.

    COSTS.json → load_costs ─┬ prefill, DEP 2 and 4: simulate(1P(DEPd) 1D, Poisson prompts of mixed
                             │   lengths at `load` x the instance's full-chunk capacity, 2-token
                             │   outputs, dp_replay="both") → mirror / lag input tok/s per GPU, cost
                             └ decode, DEP 4..32 x EPLB on/off: SimMesh(nP(DEP2) 1D(DEPd)), closed
                                 loop of batch x ranks requests → output tok/s per decode GPU over
                                 the steady window (every rank filled, until the last request sent)
      → `figures` (flat, by key) → `rows`: beside the file's `published` list (key, label, value,
        source, why the model differs) → table, JSON, PNG (`write_plot`)
    --measure-balancedness LOADS: pdmesh's EPLB planner on expert-load windows → the cost file's
    `moe.balancedness` block (per-step mean / max rank load, EPLB on and off, per DEP size).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from statistics import median
from typing import Any

from pdmesh_bench.serve import Result, ServeOptions, closed_loop
from pdmesh_bench.sim.costs import Costs, load_costs
from pdmesh_bench.sim.mesh import GatewayOptions, Topology
from pdmesh_bench.traces import Job
from pdmesh_gateway.routing import PrefillRouting

FEEDER_DEP = 2  # DEP of the prefill instances that feed the decode projection
MAX_FEEDERS = 64


@dataclass(frozen=True)
class RackOptions:
    batch: int = 128  # decode: requests per decode rank (closed loop of batch x ranks)
    context: int = 2048  # decode: prompt tokens of each request
    output_len: int = 64  # decode: mean output tokens (uniform in [0.5, 1.5] x)
    waves: int = 2  # decode: requests = waves x concurrency
    prefill_requests: int = 600  # prefill: jobs per replay (each sent once per DP rank)
    short_len: int = 1024  # prefill: prompt tokens of most jobs
    long_len: int = 8192  # prefill: prompt tokens of `long_fraction` of them
    long_fraction: float = 0.25
    load: float = 0.85  # prefill: offered load / the instance's full-chunk capacity
    lag_arrivals: float = 3.0  # prefill: the lag replay's lag, in mean inter-arrival times
    max_prefill_inflight: int = 16  # prefill: the gateway's prompts in flight per prefill rank
    seed: int = 0
    prefill_deps: tuple[int, ...] = (2, 4)
    decode_deps: tuple[int, ...] = (4, 8, 16, 32)


QUICK = RackOptions(batch=8, output_len=24, prefill_requests=200)


def _gateway(o: RackOptions, eplb: bool, inflight: int | None = None) -> GatewayOptions:
    return GatewayOptions(
        max_prefill_inflight=inflight or o.max_prefill_inflight,
        prefill_routing=PrefillRouting.LEAST_LOADED,
        eplb=eplb,
    )


# ----- prefill ----------------------------------------------------------------------------------


def prefill_workload(costs: Costs, dep: int, o: RackOptions) -> ServeOptions:
    """Poisson arrivals at `o.load` x the rate one rank prefills full chunks at (mirror, no
    attention), mixed prompt lengths, 2-token outputs, mirror-lag-mirror replays."""
    chunk = costs.max_num_batched_tokens
    capacity = chunk / costs.step_s([(chunk, 0)] * dep)  # tokens/s of one rank
    mean_prompt = (1 - o.long_fraction) * o.short_len + o.long_fraction * o.long_len
    rate = o.load * capacity / mean_prompt
    return ServeOptions(
        synthetic=True,
        rate=rate,
        num_requests=o.prefill_requests,
        input_len=o.short_len,
        output_len=2,
        long_input_len=o.long_len,
        long_fraction=o.long_fraction,
        dp_replay="both",
        lag_s=o.lag_arrivals / rate,
        seed=o.seed,
    )


def project_prefill(costs: Costs, dep: int, o: RackOptions) -> dict[str, Any]:
    """Input tokens/s per GPU of a DEP`dep` prefill instance, balanced (mirror) and not (lag)."""
    from pdmesh_bench.sim.simulate import simulate  # the engine's imports, only when it runs

    workload = prefill_workload(costs, dep, o)
    result = simulate(costs, Topology(1, 1, dep, 1), _gateway(o, True), workload)
    cost = result["dp_replay"]["imbalance_cost"]
    return {
        "dep": dep,
        "mirror_tokens_per_s_per_gpu": cost["prefill_tokens_per_s_mirror"] / dep,
        "lag_tokens_per_s_per_gpu": cost["prefill_tokens_per_s_lag"] / dep,
        "imbalance_cost": cost["throughput"],
        "rate_per_rank": workload.rate,
        "lag_s": workload.lag_s,
        "num_errors": result["num_errors"],
    }


# ----- decode -----------------------------------------------------------------------------------


def decode_jobs(count: int, o: RackOptions, unique: int) -> list[Job]:
    """`count` requests of `o.context` prompt tokens: a prefix every prompt shares, then `unique`
    tokens of its own (the first two make it unique), so that prefill computes `unique` tokens a
    request while decode holds the whole context; outputs uniform in [0.5, 1.5] x output_len."""
    unique = min(unique, o.context)
    shared = [16 + k % 1000 for k in range(o.context - unique)]
    tail = [17 + k % 997 for k in range(max(unique - 2, 0))]
    low, high = max(1, o.output_len // 2), max(1, o.output_len * 3 // 2)
    jobs = []
    for i in range(count):
        prompt = [*shared, 16 + i // 1000 % 1000, 16 + i % 1000, *tail][: o.context]
        jobs.append(Job(i, prompt, low + (i * 7919) % (high - low + 1), None))
    return jobs


def num_feeders(costs: Costs, dep: int, eplb: bool, o: RackOptions) -> int:
    """DEP2 prefill instances for 4x the decode instance's steady demand of new prompt tokens
    (one block a request), so that decode seldom waits on prefill."""
    step = costs.step_s([(o.batch, o.batch * o.context)] * dep, eplb=eplb)
    demand = (
        dep * o.batch / (o.output_len * (step + costs.overheads.token(None))) * costs.block_size
    )
    chunk = costs.max_num_batched_tokens
    supply = FEEDER_DEP * chunk / costs.step_s([(chunk, 0)] * FEEDER_DEP, eplb=eplb)
    return max(1, min(MAX_FEEDERS, math.ceil(4 * demand / supply)))


def project_decode(costs: Costs, dep: int, eplb: bool, o: RackOptions) -> dict[str, Any]:
    """Output tokens/s per GPU of a DEP`dep` decode instance with EPLB on or off."""
    from pdmesh_bench.sim.clock import run_virtual
    from pdmesh_bench.sim.mesh import SimMesh

    feeders = num_feeders(costs, dep, eplb, o)
    topology = Topology(feeders, 1, FEEDER_DEP, dep)
    concurrency = dep * o.batch
    jobs = decode_jobs(o.waves * concurrency, o, costs.block_size)
    gateway = _gateway(o, eplb, costs.max_num_batched_tokens // costs.block_size)

    async def main() -> list[Result]:
        mesh = SimMesh(costs, topology, gateway)
        try:
            return await closed_loop(mesh, jobs, concurrency, None)
        finally:
            mesh.close()

    results = run_virtual(main())
    return {"dep": dep, "eplb": eplb, "prefill_instances": feeders, **steady(results, dep, o)}


def steady(results: Sequence[Result], dep: int, o: RackOptions) -> dict[str, Any]:
    """Tokens in [the time every rank first held its batch, the last request's send] per second
    and decode GPU; the decode ITL p50 over that window."""
    ok = [r for r in results if r.ok]
    firsts = sorted(r.token_times[0] for r in ok)
    start = firsts[min(dep * o.batch, len(firsts)) - 1]
    end = max(r.start for r in results)
    if end <= start:
        raise ValueError("no steady window: give more waves or longer outputs")
    tokens = sum(start <= t <= end for r in ok for t in r.token_times)
    itl = [b - a for r in ok for a, b in pairwise(r.token_times[1:]) if start <= a and b <= end]
    return {
        "output_tokens_per_s_per_gpu": tokens / (end - start) / dep,
        "window_s": [start, end],
        "itl_ms_p50": median(itl) * 1e3 if itl else None,
        "num_errors": sum(not r.ok for r in results),
    }


# ----- the projection ---------------------------------------------------------------------------


def project(costs: Costs, published: list[dict[str, Any]], o: RackOptions) -> dict[str, Any]:
    """Every prefill and decode run (progress on stderr), the figures, the rows."""
    prefill = []
    for dep in o.prefill_deps:
        print(f"bench rack: prefill DEP{dep} (mirror, lag, mirror)", file=sys.stderr)
        prefill.append(project_prefill(costs, dep, o))
    decode = []
    for dep in o.decode_deps:
        for eplb in (True, False):
            print(f"bench rack: decode DEP{dep}, EPLB {'on' if eplb else 'off'}", file=sys.stderr)
            decode.append(project_decode(costs, dep, eplb, o))
    report: dict[str, Any] = {"prefill": prefill, "decode": decode, "options": asdict(o)}
    report["figures"] = figures(report, costs)
    report["rows"] = rows(report["figures"], published)
    return report


def figures(report: dict[str, Any], costs: Costs) -> dict[str, float]:
    """The projected figures by key (the `key` of a `published` entry)."""
    out: dict[str, float] = {}
    for p in report["prefill"]:
        out[f"prefill_mirror.{p['dep']}"] = p["mirror_tokens_per_s_per_gpu"]
        out[f"prefill_lag.{p['dep']}"] = p["lag_tokens_per_s_per_gpu"]
        out[f"imbalance.{p['dep']}"] = p["imbalance_cost"]
    if out.get("prefill_lag.2") and out.get("prefill_lag.4"):
        out["prefill_ratio"] = out["prefill_lag.2"] / out["prefill_lag.4"]
    for d in report["decode"]:
        out[f"decode_{'eplb' if d['eplb'] else 'none'}.{d['dep']}"] = d[
            "output_tokens_per_s_per_gpu"
        ]
    for dep in sorted({d["dep"] for d in report["decode"]} | {32}):
        out[f"balance_eplb.{dep}"] = costs.balance(dep, True)
        out[f"balance_none.{dep}"] = costs.balance(dep, False)
    return out


def rows(projected: dict[str, float], published: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per published figure whose key was projected: sim, published, sim / published."""
    return [
        {**ref, "sim": projected[ref["key"]], "ratio": projected[ref["key"]] / ref["value"]}
        for ref in published
        if projected.get(ref["key"]) is not None
    ]


def print_table(report: dict[str, Any], name: str) -> None:
    print(f"pdmesh bench rack: {name}")
    print(f"  {'figure':<44} {'sim':>9} {'published':>10} {'sim/pub':>8}")
    for row in report["rows"]:
        fmt = _fraction if row.get("fraction") else _amount
        sim, pub = fmt(row["sim"]), fmt(row["value"])
        print(f"  {row['label']:<44} {sim:>9} {pub:>10} {row['ratio']:>8.2f}")
        print(f"      source: {row['source']}\n      why: {row['why']}")
    for p in report["prefill"]:
        print(
            f"  prefill DEP{p['dep']}: mirror {_amount(p['mirror_tokens_per_s_per_gpu'])}, lag "
            f"{_amount(p['lag_tokens_per_s_per_gpu'])} in tok/s/GPU, cost "
            f"{_fraction(p['imbalance_cost'])} ({p['rate_per_rank']:.1f} req/s per rank, lag "
            f"{p['lag_s'] * 1e3:.0f} ms)"
        )
    decode = {(d["dep"], d["eplb"]): d for d in report["decode"]}
    for dep in sorted({dep for dep, _ in decode}):
        on, off = decode.get((dep, True)), decode.get((dep, False))
        if on and off:
            print(
                f"  decode DEP{dep}: EPLB on {_amount(on['output_tokens_per_s_per_gpu'])}, off "
                f"{_amount(off['output_tokens_per_s_per_gpu'])} out tok/s/GPU; ITL p50 "
                f"{on['itl_ms_p50'] or 0:.1f} / {off['itl_ms_p50'] or 0:.1f} ms"
            )


def _amount(value: float) -> str:
    return f"{value / 1e3:.1f}K" if abs(value) >= 1e3 else f"{value:.3g}"


def _fraction(value: float) -> str:
    return f"{value:.3f}"


# ----- balancedness from expert loads ------------------------------------------------------------


@dataclass(frozen=True)
class BalanceOptions:
    deps: tuple[int, ...] = (2, 4, 8, 16, 32)
    redundant: int = 32  # EPLB's redundant slots per layer (none: the E-slot identity layout)
    tokens_per_rank: int = 128  # tokens of a sampled step, per rank
    top_k: int = 6  # experts per token (V4-Flash routes to 6)
    samples: int = 4  # sampled steps per loads file and DEP size
    seed: int = 0
    files: list[str] = field(default_factory=list)


def measure_balancedness(o: BalanceOptions) -> dict[str, dict[str, float]]:
    """Per-step balancedness (mean over MoE layers, sampled steps and files) of pdmesh's plan
    (`pdmesh_eplb.planner.plan`, fitted on each file's window) and of the identity layout."""
    import numpy as np

    from pdmesh_eplb.planner import load_loads, plan
    from pdmesh_eplb.simulate import per_step_balancedness, sample_step_loads

    rng = np.random.default_rng(o.seed)
    out: dict[str, dict[str, float]] = {"eplb": {}, "none": {}}
    for dep in o.deps:
        scores: dict[str, list[float]] = {"eplb": [], "none": []}
        for path in o.files:
            loads = load_loads(path)
            moe = loads.sum(1) > 0
            layouts = {
                "eplb": plan(loads, dep, o.redundant).physical_to_logical,
                "none": np.tile(np.arange(loads.shape[1]), (len(loads), 1)),
            }
            for _ in range(o.samples):
                step = sample_step_loads(loads, o.tokens_per_rank * dep, o.top_k, rng)
                for kind, p2l in layouts.items():
                    score = per_step_balancedness(step, p2l, dep, rng)[moe].mean()
                    scores[kind].append(float(score))
        for kind, values in scores.items():
            out[kind][str(dep)] = round(float(np.mean(values)), 3)
    return out


# ----- command line -----------------------------------------------------------------------------


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("rack", help="rack-scale projection of a GPU cost file by simulation")
    p.add_argument("--costs", type=Path, help="the cost file (sim/examples/gb300-v4-flash.json)")
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--plot", type=Path, help="PNG: prefill and decode per GPU, two panels")
    p.add_argument("--quick", action="store_true", help="small runs (tests)")
    d = RackOptions()
    p.add_argument("--batch", type=int, default=d.batch, help="decode requests per rank")
    p.add_argument("--context", type=int, default=d.context, help="decode prompt tokens")
    p.add_argument("--output-len", type=int, default=d.output_len, help="decode mean output")
    p.add_argument("--seed", type=int, default=d.seed, help="the prefill arrivals and prompt mix")
    p.add_argument(
        "--measure-balancedness",
        nargs="+",
        metavar="LOADS",
        help='expert-load files {"logical_count": ...}: print the moe.balancedness block instead',
    )
    p.add_argument("--tokens-per-rank", type=int, default=128, help="of a sampled step")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.measure_balancedness:
        o = BalanceOptions(tokens_per_rank=args.tokens_per_rank, files=args.measure_balancedness)
        print(json.dumps({"balancedness": measure_balancedness(o), "options": asdict(o)}, indent=2))
        return 0
    if args.costs is None:
        raise ValueError("give --costs FILE (or --measure-balancedness LOADS)")
    costs = load_costs(args.costs)
    published = json.loads(args.costs.read_text()).get("published", [])
    options = QUICK if args.quick else RackOptions(args.batch, args.context, args.output_len)
    report = project(costs, published, replace(options, seed=args.seed))
    report["costs"] = {"file": args.costs.name, "name": costs.name, "source": costs.source}
    print_table(report, f"{costs.name} ({args.costs.name})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        print(f"pdmesh bench rack: wrote {write_plot(args.plot, report)}")
    return 0


def write_plot(path: Path, report: dict[str, Any]) -> Path:
    """Left: prefill input tok/s per GPU by DEP (mirror, lag, published); right: decode output
    tok/s per GPU by DEP, EPLB on and off, with the published decode points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    prefill, projected = report["prefill"], report["figures"]
    published = {r["key"]: r["value"] for r in report["rows"]}
    bars = [
        (name, [values.get(f"{key}.{p['dep']}", 0) for p in prefill])
        for name, values, key in [
            ("sim, mirror", projected, "prefill_mirror"),
            ("sim, lag", projected, "prefill_lag"),
            ("published", published, "prefill_lag"),
        ]
    ]
    for i, (label, values) in enumerate(bars):
        left.bar([k + (i - 1) * 0.27 for k in range(len(prefill))], values, 0.27, label=label)
    left.set_xticks(range(len(prefill)), [f"DEP{p['dep']}" for p in prefill])
    left.set(ylabel="input tokens/s per GPU", title="prefill")
    for eplb in (True, False):
        runs = [d for d in report["decode"] if d["eplb"] is eplb]
        xs, ys = [d["dep"] for d in runs], [d["output_tokens_per_s_per_gpu"] for d in runs]
        right.plot(xs, ys, marker="o", label=f"sim, EPLB {'on' if eplb else 'off'}")
    for row in report["rows"]:
        if row["key"].startswith("decode_") and row["value"] < 1e5:  # output tokens only
            dep = int(row["key"].split(".")[1])
            right.scatter([dep], [row["value"]], marker="x", color="black")
            right.annotate(row["label"].split("(")[-1].rstrip(")"), (dep, row["value"]), size=7)
    right.set_xscale("log", base=2)
    deps = report["options"]["decode_deps"]
    right.set_xticks(list(deps), [f"DEP{d}" for d in deps])
    right.set(xlabel="decode DEP size", ylabel="output tokens/s per GPU", title="decode")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"pdmesh bench rack: {report.get('costs', {}).get('name', '')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m pdmesh_bench.sim.rack ...`, as `pdmesh bench rack ...`."""
    parser = argparse.ArgumentParser(prog="pdmesh bench")
    register(parser.add_subparsers(dest="bench_command", required=True))
    return run(parser.parse_args(["rack", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    raise SystemExit(main())
