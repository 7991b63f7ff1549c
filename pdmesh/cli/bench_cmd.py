"""`pdmesh bench ...`: each benchmark module registers its own subcommand."""
from __future__ import annotations

import argparse
import importlib

BENCHMARKS = ("engine", "forward")


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("bench", help="benchmarks (each reports side-by-side ratios)")
    sub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name in BENCHMARKS:
        try:
            module = importlib.import_module(f"pdmesh.bench.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"pdmesh.bench.{name}":
                raise
            continue
        module.register(sub)
