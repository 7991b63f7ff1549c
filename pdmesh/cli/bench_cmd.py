"""`pdmesh bench NAME [...]`: each benchmark module registers its own subcommand.

A benchmark's module is imported only when it runs, so other commands stay quick to start.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = (
    "engine",
    "forward",
    "serve",
    "kvxfer",
    "allreduce",
    "decode",
    "eplb",
    "chaos",
    "admission",
    "routing",
    "overload",
    "grammar",
    "soak",
    "tenants",
    "autoscale",
    "costs",
    "simcheck",
    "rack",
)


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS), add_help=False)
    p.add_argument("benchmark", choices=BENCHMARKS, help="which benchmark")
    p.add_argument("options", nargs=argparse.REMAINDER, help="its options (NAME --help lists them)")
    p.set_defaults(run=run)


MODULES = {"rack": "pdmesh_bench.sim.rack"}  # benchmarks that live beside the simulator


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(MODULES.get(args.benchmark, f"pdmesh_bench.{args.benchmark}"))
    parser = argparse.ArgumentParser(prog="pdmesh bench")
    module.register(parser.add_subparsers(dest="bench_command", required=True))
    options = parser.parse_args([args.benchmark, *args.options])
    return int(options.run(options) or 0)
