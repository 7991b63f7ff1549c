"""`pdmesh sim`: replay a workload against a simulated mesh (`pdmesh bench serve`'s workload
options, `pdmesh up`'s topology options, the gateway's routing options) on a cost file; `--json`
has the keys of `pdmesh bench serve --json` plus `sim` (and `goodput` with `--slo-*`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pdmesh_bench.serve import ServeOptions, add_workload_arguments, print_summary
from pdmesh_bench.sim.costs import load_costs
from pdmesh_bench.sim.mesh import GatewayOptions, Topology
from pdmesh_bench.sim.slo import Slo, goodput
from pdmesh_gateway.routing import LocalPrefill, PrefillRouting


def add_topology_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costs", type=Path, required=True, help="cost file (pdmesh bench costs)")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances (disagg)")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument("--prefill-dep", type=int, default=1, help="ranks per prefill instance")
    p.add_argument("--decode-dep", type=int, default=1, help="ranks per decode instance")
    p.add_argument("--mode", choices=("disagg", "agg"), default="disagg")


def add_gateway_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the gateway and the ranks (as `pdmesh up` takes them)")
    d = GatewayOptions()
    g.add_argument("--max-prefill-inflight", type=int, default=d.max_prefill_inflight)
    g.add_argument(
        "--prefill-routing",
        type=PrefillRouting,
        choices=list(PrefillRouting),
        default=d.prefill_routing,
    )
    g.add_argument(
        "--local-prefill-tokens",
        type=LocalPrefill.parse,
        default=d.local_prefill,
        metavar="off|auto|N",
    )
    g.add_argument("--max-queued", type=int, help="429 past this many queued requests")
    g.add_argument("--max-queue-wait-s", type=float, help="429 past this estimated wait")
    g.add_argument("--no-eplb", action="store_true", help="DEP: experts as routed (no EPLB)")
    g.add_argument("--torch-threads", type=int, help="per rank (CPU; default cores // ranks)")
    g.add_argument(
        "--max-kv-loads-per-step", type=int, help="decode: arrived requests admitted per step"
    )


def add_slo_arguments(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--slo-ttft-ms", type=float, required=required, help="TTFT target")
    p.add_argument("--slo-tpot-ms", type=float, required=required, help="TPOT target")


def topology_of(args: argparse.Namespace) -> Topology:
    return Topology(args.prefill, args.decode, args.prefill_dep, args.decode_dep, args.mode)


def gateway_of(args: argparse.Namespace) -> GatewayOptions:
    return GatewayOptions(
        args.max_prefill_inflight,
        args.prefill_routing,
        args.local_prefill_tokens,
        args.max_queued,
        args.max_queue_wait_s,
        not args.no_eplb,
        args.torch_threads,
        args.max_kv_loads_per_step,
    )


def slo_of(args: argparse.Namespace) -> Slo | None:
    if args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        return None
    inf = float("inf")
    return Slo(args.slo_ttft_ms or inf, args.slo_tpot_ms or inf)


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("sim", help="simulate a mesh on a cost file")
    add_topology_arguments(p)
    add_gateway_arguments(p)
    add_workload_arguments(p)
    add_slo_arguments(p)
    p.add_argument("--json", type=Path, help="write the results (bench serve's keys) here")
    p.add_argument("--label", help="this run's name in plots (default: the topology)")
    p.add_argument("--plot", type=Path, help="PNG: TTFT and e2e CDFs, the queue over time")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pdmesh_bench.sim.simulate import simulate  # the engine's imports, only when it runs

    if args.trace is None and not args.synthetic:
        raise ValueError("give a workload: --trace FILE or --synthetic")
    costs, topology = load_costs(args.costs), topology_of(args)
    options = ServeOptions.from_args(args)
    result = simulate(costs, topology, gateway_of(args), options)
    label = args.label or str(topology)
    result["config"]["label"] = label
    print(f"pdmesh sim: {topology} on {args.costs} ({costs.source or 'no source'})")
    if "dp_replay" in result:
        from pdmesh_bench.dp_replay import print_report

        print_report(result)
    else:
        slo = slo_of(args)
        if slo is not None:
            result["goodput"] = goodput(result, slo)
        print_summary(result)
        print_sim(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        from pdmesh_bench.sim.plots import write_run_plot

        print(f"pdmesh sim: wrote {write_run_plot(args.plot, result, label)}")
    return 0


def print_sim(result: dict[str, Any]) -> None:
    sim = result["sim"]
    queue = sim["queue_s"]
    print(
        f"  per rank {sim['output_tokens_per_s_per_rank']:.1f} out tok/s over {sim['num_ranks']} "
        f"ranks; gateway queue p50/p90 {_ms(queue['p50'])}/{_ms(queue['p90'])} ms; "
        f"{sim['num_local_prefills']} local prefills, {sim['num_disaggregated']} hand-offs"
    )
    for name, inst in sim["instances"].items():
        print(f"  {name:<12} busy {inst['busy_fraction']:6.1%}  steps {inst['steps']}")
    if "goodput" in result:
        g = result["goodput"]
        rate = g["goodput_tokens_per_s"]
        print(f"  SLO attainment {g['attainment']:.1%}, goodput {rate:.1f} tok/s")


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.0f}"
