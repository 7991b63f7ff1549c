"""One entry point for every service: `python -m pdmesh_<role>` and `pdmesh serve ROLE` both land
here.

argv → server.add_arguments / config_from_args (validated once) → run_service(server.serve(config))
                                                    or, for `--dep N` workers, `server.supervise`
"""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType

from pdmesh_service.options import CommonConfig, run_service

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def process_environment(common: CommonConfig) -> None:
    """The one environment setting made for libraries that read nothing else: UCX (under NIXL)
    listens on the devices in UCX_NET_DEVICES, so a service bound to loopback keeps its KV transport
    there too. Set once, at process start, before any agent exists; a value given by the deployment
    wins."""
    if common.host in LOOPBACK_HOSTS or common.host.startswith("127."):
        os.environ.setdefault("UCX_NET_DEVICES", "lo")


def serve_main(role: str, server: ModuleType, argv: list[str] | None = None) -> int:
    """Parse `argv` with the role's own options and serve until SIGINT/SIGTERM; returns the exit
    code."""
    argv = sys.argv[1:] if argv is None else argv
    # No abbreviations: `--mesh-token SECRET` must not pass for --mesh-token-file and put the
    # secret in an error message; a typo is an error, never a different option.
    parser = argparse.ArgumentParser(prog=f"pdmesh serve {role}", allow_abbrev=False)
    server.add_arguments(parser)
    options = parser.parse_args(argv)
    try:
        config = server.config_from_args(options)
    except ValueError as e:
        parser.error(str(e))
    process_environment(config.common)
    dep = getattr(config, "dep", None)
    if dep is not None and dep.is_supervisor:
        code: int = server.supervise(role, argv, config)  # worker roles: one process per DEP rank
        return code
    return run_service(role, config.common, lambda: server.serve(config))
