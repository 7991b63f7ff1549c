"""`pdmesh bench simcheck`: the simulator against the real mesh, side by side in one run.

For every topology (`--topologies 1P1D,2P1D,agg`) and every workload (`--serve NAME='bench serve
options'`, repeated), the real mesh is started on this machine (`pdmesh up`'s launcher, loopback,
one mesh at a time), `pdmesh bench serve` replays the workload against it, the mesh is stopped, and
`pdmesh sim` replays the same workload (same requests, lengths, arrivals and seed) against the cost
file (`pdmesh bench costs`, measured just before on the same machine). Compared: TTFT p50 and p90,
ITL p50 and output tokens/s; `error` = simulated / measured - 1; a cell passes within
`--tolerance` (default 15%).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdmesh_bench import serve
from pdmesh_bench.routing import serve_options
from pdmesh_bench.sim.costs import Costs, load_costs
from pdmesh_bench.sim.mesh import GatewayOptions, Topology

METRICS = (
    ("TTFT p50", ("ttft_ms", "p50")),
    ("TTFT p90", ("ttft_ms", "p90")),
    ("ITL p50", ("itl_ms", "p50")),
    ("out tok/s", ("output_tokens_per_s", None)),
)


def parse_topology(text: str) -> Topology:
    """`1P1D`, `2P1D`, `agg` (one decode instance) or `agg2D`."""
    found = re.fullmatch(r"(\d+)P(\d+)D", text.strip())
    if found:
        return Topology(int(found[1]), int(found[2]))
    found = re.fullmatch(r"agg(?:(\d+)D)?", text.strip())
    if found:
        return Topology(0, int(found[1] or 1), mode="agg")
    raise ValueError(f"topology {text!r}: write 1P1D, 2P1D, agg or agg2D")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simcheck", help="pdmesh sim against the real mesh, side by side")
    p.add_argument("--costs", type=Path, required=True, help="cost file (pdmesh bench costs)")
    p.add_argument("--topologies", default="1P1D,2P1D,agg")
    p.add_argument(
        "--serve",
        action="append",
        required=True,
        metavar="NAME=OPTIONS",
        help="a workload: its name and `pdmesh bench serve` options (quoted); repeat",
    )
    p.add_argument("--model", help="model directory (default: the cached default model)")
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--sim-only", action="store_true", help="simulate only (no mesh is started)")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, help="the meshes' logs (default: a temp dir)")
    p.add_argument("--json", type=Path, help="write the table and every run here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    costs = load_costs(args.costs)
    topologies = [parse_topology(t) for t in args.topologies.split(",")]
    workloads = dict(_named(text) for text in args.serve)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdmesh-simcheck-"))
    cells = []
    for topology in topologies:
        for name, load in workloads.items():
            measured = None if args.sim_only else run_real(args, topology, load, log_dir / name)
            cells.append(compare(costs, topology, name, load, measured, args.tolerance))
            print_cell(cells[-1])
    report = {"costs": str(args.costs), "tolerance": args.tolerance, "cells": cells}
    print_table(cells)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(c["passed"] for c in cells if c["measured"] is not None) else 1


def _named(text: str) -> tuple[str, serve.ServeOptions]:
    name, sep, options = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--serve {text!r}: write NAME='bench serve options'")
    return name.strip(), serve_options(options)


def run_real(
    args: argparse.Namespace, topology: Topology, load: serve.ServeOptions, log_dir: Path
) -> dict[str, Any]:
    from pdmesh.cli.options import resolve_model
    from pdmesh.launcher import Mesh, MeshOptions
    from pdmesh_service.redis_server import free_port

    options = MeshOptions(
        model_dir=resolve_model(Path(args.model) if args.model else None),
        num_prefill=topology.prefill if topology.mode == "disagg" else 0,
        num_decode=topology.decode,
        mode=topology.mode,
        http_port=free_port(),
        grpc_port=free_port(),
        deployment=f"bench-simcheck-{os.getpid()}",
        log_dir=log_dir / str(topology).replace(" ", "-"),
    )
    mesh = Mesh(options)
    _say(f"{topology}: starting the mesh")
    mesh.start(timeout_s=args.start_timeout_s, progress=_say)
    try:
        url = f"http://{options.host}:{options.http_port}"
        return serve.run_benchmark(replace(load, url=url, label=str(topology)))
    finally:
        mesh.stop()


def compare(
    costs: Costs,
    topology: Topology,
    name: str,
    load: serve.ServeOptions,
    measured: dict[str, Any] | None,
    tolerance: float,
) -> dict[str, Any]:
    from pdmesh_bench.sim.simulate import simulate

    max_model_len = (measured or {}).get("config", {}).get("max_model_len") or load.max_model_len
    simulated = simulate(
        costs, topology, GatewayOptions(), replace(load, max_model_len=max_model_len)
    )
    rows = []
    for label, (key, stat) in METRICS:
        sim = _value(simulated, key, stat)
        real = None if measured is None else _value(measured, key, stat)
        error = None if real in (None, 0) or sim is None else sim / real - 1
        rows.append({"metric": label, "measured": real, "simulated": sim, "error": error})
    errors = [r["error"] for r in rows]
    return {
        "topology": str(topology),
        "workload": name,
        "rows": rows,
        "passed": measured is not None
        and all(e is not None and abs(e) <= tolerance for e in errors),
        "measured": measured,
        "simulated": simulated,
    }


def _value(result: dict[str, Any], key: str, stat: str | None) -> float | None:
    value = result.get(key)
    return value.get(stat) if stat is not None and isinstance(value, dict) else value


def print_cell(cell: dict[str, Any]) -> None:
    parts = []
    for r in cell["rows"]:
        error = "" if r["error"] is None else f" ({r['error']:+.1%})"
        parts.append(f"{r['metric']} {_num(r['measured'])} vs sim {_num(r['simulated'])}{error}")
    _say(f"{cell['topology']} on {cell['workload']}: " + "; ".join(parts))


def print_table(cells: list[dict[str, Any]]) -> None:
    print(f"{'topology':<10} {'workload':<14}" + "".join(f"{m:>22}" for m, _ in METRICS) + "  pass")
    for cell in cells:
        values = "".join(
            f"{_num(r['measured']):>9} /{_num(r['simulated']):>8}"
            + (f"{r['error']:>+5.0%}" if r["error"] is not None else "  n/a")
            for r in cell["rows"]
        )
        mark = "yes" if cell["passed"] else ("-" if cell["measured"] is None else "NO")
        print(f"{cell['topology']:<10} {cell['workload']:<14}{values}  {mark}")
    print("(measured / simulated, and the simulation's error; ms, output tokens/s)")


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _say(line: str) -> None:
    print(f"bench simcheck: {line}", file=sys.stderr, flush=True)
