"""`pdmesh up`: start a whole local mesh (Redis, kvstore, prefill and decode ranks, gateway)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from pdmesh.cli.options import resolve_model
from pdmesh_service.worker.engine_options import add_engine_options, engine_argv


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("up", help="start a local mesh and serve until Ctrl-C")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances (disagg mode)")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument(
        "--prefill-dep",
        type=int,
        default=1,
        help="ranks per prefill instance (DEP: data-parallel attention, experts split over the "
        "ranks)",
    )
    p.add_argument("--decode-dep", type=int, default=1, help="ranks per decode instance (DEP)")
    p.add_argument(
        "--num-redundant-experts",
        type=int,
        default=0,
        help="extra expert slots per MoE layer of DEP instances (experts + these: a multiple of "
        "each DEP size)",
    )
    p.add_argument(
        "--dp-sync",
        default=None,
        choices=["recursive_doubling", "gloo"],
        help="DEP instances' per-step all-reduce (default: recursive_doubling)",
    )
    p.add_argument(
        "--mode",
        default="disagg",
        choices=["disagg", "agg"],
        help="disagg: prefill pushes KV to decode over NIXL; agg: decode prefills itself",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address every service binds (default: loopback)"
    )
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port (OpenAI API)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gateway gRPC port (SDK)")
    p.add_argument(
        "--redis-url", default=None, help="use this Redis (default: start a private one)"
    )
    p.add_argument("--deployment", default="default", help="namespace of this mesh's Redis keys")
    p.add_argument(
        "--max-prefill-inflight",
        type=int,
        default=None,
        help="requests per prefill rank between Reserve and the end of Prefill; others queue at "
        "the "
        "gateway (default: the gateway's)",
    )
    g = p.add_argument_group(
        "EPLB controller (started with the mesh; balances the experts of DEP instances)"
    )
    g.add_argument(
        "--no-eplb",
        action="store_true",
        help="the controller tracks placements but never rebalances",
    )
    g.add_argument(
        "--eplb-window-steps",
        type=int,
        default=None,
        help="steps of expert load one plan is fitted on",
    )
    g.add_argument(
        "--eplb-step-interval", type=int, default=None, help="steps between periodic rebalances"
    )
    p.add_argument(
        "--log-dir", type=Path, default=None, help="service logs (default: a new temp folder)"
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    add_engine_options(p)
    p.set_defaults(run=run)


def eplb_argv(args: argparse.Namespace) -> tuple[str, ...]:
    """The controller's options among `pdmesh up`'s, as its own flags."""
    argv: tuple[str, ...] = ("--no-rebalance",) if args.no_eplb else ()
    for flag, value in (
        ("--eplb-window-steps", args.eplb_window_steps),
        ("--eplb-step-interval", args.eplb_step_interval),
    ):
        argv += (flag, str(value)) if value is not None else ()
    return argv


def run(args: argparse.Namespace) -> int:
    from pdmesh.launcher import Mesh, MeshOptions

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdmesh-logs-"))
    options = MeshOptions(
        model_dir=resolve_model(args.model),
        num_prefill=args.prefill,
        num_decode=args.decode,
        mode=args.mode,
        host=args.host,
        http_port=args.port,
        grpc_port=args.grpc_port,
        redis_url=args.redis_url,
        deployment=args.deployment,
        log_dir=log_dir,
        log_level=args.log_level,
        prefill_dep=args.prefill_dep,
        decode_dep=args.decode_dep,
        num_redundant_experts=args.num_redundant_experts,
        dp_sync=args.dp_sync,
        max_prefill_inflight=args.max_prefill_inflight,
        eplb_args=eplb_argv(args),
    )
    if args.torch_threads is None:  # worker ranks share this machine's cores
        args.torch_threads = max(1, (os.cpu_count() or 1) // max(1, options.num_worker_processes))
    options = replace(options, worker_args=tuple(engine_argv(args)))
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    say(f"pdmesh up: model {options.model_dir}, mode {options.mode}, logs in {log_dir}")
    signal.signal(signal.SIGTERM, _interrupt)
    mesh = Mesh(options)
    try:
        mesh.start(timeout_s=args.startup_timeout, progress=say)
        _print_ready(options)
        while not mesh.failed():
            time.sleep(0.5)
        say(f"pdmesh up: {', '.join(mesh.failed())} exited; stopping the mesh")
        for name in mesh.failed():
            say(f"--- {name} ---\n{mesh.log_tail(name)}")
        return 1
    except KeyboardInterrupt:
        say("pdmesh up: stopping")
        return 0
    finally:
        mesh.stop()
        say("pdmesh up: stopped")


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops the mesh the same way Ctrl-C does."""
    raise KeyboardInterrupt


def _print_ready(options) -> None:
    base = f"http://{options.host}:{options.http_port}"
    body = f'{{"model": "{options.model_dir.name}", "prompt": "Hello", "max_tokens": 16}}'
    curl = f"curl -s {base}/v1/completions -H 'Content-Type: application/json' -d '{body}'"
    print(
        f"""
pdmesh is serving {options.model_dir.name}
  OpenAI API   {base}/v1
  gRPC (SDK)   {options.host}:{options.grpc_port}
  mesh view    {base}/mesh
  metrics      {base}/metrics
try:
  {curl}
Ctrl-C stops everything.""",
        flush=True,
    )
