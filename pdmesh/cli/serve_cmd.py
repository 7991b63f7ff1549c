"""`pdmesh serve ROLE [...]`: run one service in this process (`python -m pdmesh_ROLE` does the
same).

The role's own options come from its `server.py` (`add_arguments`), parsed only when that role
runs, so other commands do not import the services. Roles that load a model get the cached default
model when no `--model` is given.
"""

from __future__ import annotations

import argparse
import importlib

SERVICE_MODULES = {
    role: f"pdmesh_{role}.server" for role in ("kvstore", "eplb", "prefill", "decode", "gateway")
}
MODEL_ROLES = frozenset({"prefill", "decode", "gateway"})


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "serve", help="run one service: " + ", ".join(SERVICE_MODULES), add_help=False
    )
    p.add_argument("role", choices=sorted(SERVICE_MODULES), help="the service to run")
    p.add_argument(
        "options", nargs=argparse.REMAINDER, help="the service's options (ROLE --help lists them)"
    )
    p.set_defaults(run=run)


def with_default_model(role: str, options: list[str]) -> list[str]:
    """`options` plus `--model <cached default>` for a model role that names none (and is not asking
    --help)."""
    names = {o.split("=", 1)[0] for o in options}
    if role not in MODEL_ROLES or names & {"--model", "-h", "--help"}:
        return options
    from pdmesh.cli.options import resolve_model

    return [*options, "--model", str(resolve_model(None))]


def run(args: argparse.Namespace) -> int:
    """Serve the role; with `--dep N` (prefill, decode) supervise the instance's N rank
    processes."""
    from pdmesh_service.entry import serve_main

    server = importlib.import_module(SERVICE_MODULES[args.role])
    return serve_main(args.role, server, with_default_model(args.role, list(args.options)))
