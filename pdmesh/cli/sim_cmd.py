"""`pdmesh sim` and `pdmesh plan`: the simulator (`pdmesh_bench.sim`), imported when it runs."""

from __future__ import annotations

import argparse
import importlib

COMMANDS = {
    "sim": ("pdmesh_bench.sim.cli", "simulate a mesh on a cost file (pdmesh bench costs)"),
    "plan": ("pdmesh_bench.sim.plan", "the cheapest topology that meets SLOs, by simulation"),
}


def register(commands: argparse._SubParsersAction) -> None:
    for name, (_, help) in COMMANDS.items():
        p = commands.add_parser(name, help=help, add_help=False)
        p.set_defaults(run=run, passes_options=True)


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(COMMANDS[args.command][0])
    parser = argparse.ArgumentParser(prog="pdmesh")
    module.register(parser.add_subparsers(dest="command", required=True))
    options = parser.parse_args([args.command, *args.options])
    return int(options.run(options) or 0)
