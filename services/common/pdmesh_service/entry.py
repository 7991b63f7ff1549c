"""One entry point for every service: `python -m pdmesh_<role>` and `pdmesh serve ROLE` both land here.

    argv → server.add_arguments / config_from_args (validated once) → run_service(server.serve(config))
                                                        or, for `--dep N` workers, `server.supervise`
"""
from __future__ import annotations

import argparse
import sys
from types import ModuleType

from pdmesh_service.options import run_service


def serve_main(role: str, server: ModuleType, argv: list[str] | None = None) -> int:
    """Parse `argv` with the role's own options and serve until SIGINT/SIGTERM; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog=f"pdmesh serve {role}")
    server.add_arguments(parser)
    options = parser.parse_args(argv)
    try:
        config = server.config_from_args(options)
    except ValueError as e:
        parser.error(str(e))
    dep = getattr(config, "dep", None)
    if dep is not None and dep.is_supervisor:
        return server.supervise(role, argv, config)       # worker roles: one process per DEP rank
    return run_service(role, config.common, lambda: server.serve(config))
