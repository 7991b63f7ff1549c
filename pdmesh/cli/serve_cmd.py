"""`pdmesh serve ROLE [...]`: run one service in this process (what a container runs).

The role's own options come from its `server.py` (`add_arguments`), parsed only when that role
runs, so other commands do not import the services.
"""
from __future__ import annotations

import argparse
import importlib

SERVICE_MODULES = {
    "kvstore": "pdmesh.services.kvstore.server",
    "prefill": "pdmesh.services.prefill.server",
    "decode": "pdmesh.services.decode.server",
    "gateway": "pdmesh.services.gateway.server",
}


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("serve", help="run one service: " + ", ".join(SERVICE_MODULES), add_help=False)
    p.add_argument("role", choices=sorted(SERVICE_MODULES), help="the service to run")
    p.add_argument("options", nargs=argparse.REMAINDER, help="the service's options (ROLE --help lists them)")
    p.set_defaults(run=run)


def role_parser(role: str) -> tuple[argparse.ArgumentParser, object]:
    module = importlib.import_module(SERVICE_MODULES[role])
    parser = argparse.ArgumentParser(prog=f"pdmesh serve {role}")
    module.add_arguments(parser)
    return parser, module


def run(args: argparse.Namespace) -> int:
    """Serve the role; with `--dep N` (prefill, decode) supervise the instance's N rank processes."""
    from pdmesh.services.common.options import run_service

    parser, module = role_parser(args.role)
    options = parser.parse_args(args.options)
    config = module.config_from_args(options)
    dep = getattr(config, "dep", None)
    if dep is not None and dep.is_supervisor:
        from pdmesh.services.worker.dep_instance import run_instance

        return run_instance(args.role, list(args.options), config.common, config.model_dir, dep)
    return run_service(args.role, config.common, lambda: module.serve(config))
