"""`pdmesh eplb ACTION [...]`: offline expert-placement (EPLB) tools of the eplb service's package.

`pdmesh eplb plan --loads LOADS.json --ranks R --redundant S [--nodes N] [--previous PLAN.json]
[--move-budget F] --out PLAN.json` runs `pdmesh_eplb.planner.main`; its options are parsed there
(`pdmesh eplb plan --help` lists them). The module is imported only when the action runs, so other
commands stay quick to start.
"""

from __future__ import annotations

import argparse
import importlib

ACTION_MODULES = {"plan": "pdmesh_eplb.planner"}  # action -> module whose main(argv) -> int runs


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "eplb", help="expert placement offline: " + ", ".join(ACTION_MODULES), add_help=False
    )
    p.add_argument("action", choices=sorted(ACTION_MODULES), help="what to do")
    p.add_argument(
        "options", nargs=argparse.REMAINDER, help="its options (ACTION --help lists them)"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(ACTION_MODULES[args.action])
    return int(module.main(list(args.options)) or 0)
