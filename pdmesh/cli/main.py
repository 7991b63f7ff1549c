"""`pdmesh` entry point: subcommands are registered by the modules beside this one."""

from __future__ import annotations

import argparse
import sys

from pdmesh_engine.config import CheckpointError


def build_parser() -> argparse.ArgumentParser:
    from pdmesh.cli import (
        bench_cmd,
        client_cmd,
        eplb_cmd,
        generate_cmd,
        model_cmd,
        serve_cmd,
        sim_cmd,
        up_cmd,
    )

    parser = argparse.ArgumentParser(
        prog="pdmesh",
        description="Serve Mixture-of-Experts models with prefill/decode disaggregation.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model_cmd.register(commands)
    generate_cmd.register(commands)
    bench_cmd.register(commands)
    client_cmd.register(commands)
    up_cmd.register(commands)
    serve_cmd.register(commands)
    eplb_cmd.register(commands)
    sim_cmd.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passes_options", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if getattr(args, "passes_options", False):
        args.options = rest  # the command parses its own options (it is imported when it runs)
    try:
        return int(args.run(args) or 0)
    except (ValueError, CheckpointError, FileNotFoundError) as e:
        print(f"pdmesh {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
