"""`pdmesh model init`: write a seeded random-weight checkpoint of the DeepSeek-V3 architecture."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("model", help="model checkpoints")
    sub = p.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    init = sub.add_parser("init", help="write a seeded random checkpoint in Hugging Face layout")
    init.add_argument("dir", type=Path)
    init.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    init.add_argument(
        "--expert-skew",
        type=float,
        default=0.0,
        metavar="ZIPF_S",
        help="Zipf exponent of expert popularity per MoE layer, each layer ranking "
        "experts differently (default 0: near-uniform routing)",
    )
    init.set_defaults(run=run_init)


def run_init(args: argparse.Namespace) -> int:
    from pdmesh.tools.model_init import init_model

    path = init_model(
        args.dir, preset=args.preset, seed=args.seed, dtype=args.dtype, expert_skew=args.expert_skew
    )
    print(path)
    return 0
