"""`pdmesh up`: start a whole local mesh (Redis, kvstore, prefill and decode ranks, gateway) and
keep it up: a process that dies is restarted with the same options (same instance id and ports)
after a backoff of 0.5 s doubling to 10 s (reset once it served for 60 s); a service restarted
--max-restarts times within 10 minutes that dies again makes the launcher give up: it prints that
service's last log lines and stops the whole mesh (exit 1).

With `--autoscale prefill=1..3,decode=1..2` the named pools start at their lower bounds; the gateway
decides their size from the load and the launcher starts or drains workers to match
(`pdmesh.autoscaler`), printing a line per event."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from pdmesh.cli.options import resolve_model
from pdmesh.launcher import DEFAULT_AUTOSCALE_DRAIN_S, DEFAULT_WORKER_NICE, MeshOptions
from pdmesh_service.scaling import PoolBounds, parse_bounds
from pdmesh_service.supervision import RestartPolicy
from pdmesh_service.worker.engine_options import (
    add_engine_options,
    add_kv_integrity_options,
    add_speculative_options,
    engine_argv,
    worker_engine_config,
)

API_KEY_ENV, MESH_TOKEN_ENV = "PDMESH_API_KEY", "PDMESH_MESH_TOKEN"
# the gateway's autoscale settings `pdmesh up` passes on (`pdmesh serve gateway --help`)
AUTOSCALE_SETTINGS = (
    ("interval_s", "seconds between two decisions"),
    ("window_s", "seconds of recent load each decision reads"),
    ("target_queue_s", "grow above this queue time at the gateway (p90)"),
    ("target_utilization", "grow above this pool utilisation"),
    ("low_utilization", "shrink only while the utilisation with one replica fewer stays below it"),
    ("cooldown_s", "the low load must last this long (since the pool's last change) to shrink"),
    ("up_cooldown_s", "seconds after a pool's last step was served before it grows again"),
    ("up_stable_s", "grow only once the pool was the bottleneck this long without a break"),
)


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
        "--worker-nice",
        type=int,
        default=DEFAULT_WORKER_NICE,
        help="nice value of the prefill and decode ranks: when they saturate the CPU, the gateway "
        "and the control plane still answer at once (0: same priority; default %(default)s)",
    )
    p.add_argument(
        "--max-prefill-inflight",
        type=int,
        default=None,
        help="requests per prefill rank between Reserve and the end of Prefill; others queue at "
        "the gateway (default: the gateway's)",
    )
    routing = p.add_argument_group("routing (the gateway's; `pdmesh serve gateway --help`)")
    routing.add_argument("--prefill-routing", choices=["cache-aware", "least-loaded"])
    routing.add_argument("--local-prefill-tokens", metavar="off|auto|N")
    routing.add_argument("--decode-balance", choices=["requests", "kv-tokens"])
    routing.add_argument(
        "--max-queued",
        type=int,
        help="requests that may wait at the gateway; more get 429 at once (default: the gateway's)",
    )
    routing.add_argument(
        "--max-queue-wait-s", type=float, help="also 429 past this estimated wait (default: none)"
    )
    routing.add_argument(
        "--api-keys-file",
        help="the gateway's tenants: API keys with their limits and priority classes (JSON or "
        "YAML; see `pdmesh serve gateway --help`)",
    )
    routing.add_argument(
        "--queue-timeout-s", type=float, help="408 past this wait in the gateway's fair queue"
    )
    _add_autoscale_arguments(p)
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
    p.add_argument(
        "--max-restarts",
        type=int,
        default=RestartPolicy.max_restarts,
        help="restarts per service within 10 minutes; past that the launcher gives up and stops "
        "the mesh (exit 1). 0: any process that exits stops the mesh",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV, ""),
        help=f"clients of the gateway must send it (Authorization: Bearer KEY); default: "
        f"${API_KEY_ENV}. Passed to the gateway in its environment, never in its argv",
    )
    add_engine_options(p)
    add_speculative_options(p)
    add_kv_integrity_options(p, faults=False)
    p.set_defaults(run=run)


def _add_autoscale_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "autoscaling (the gateway decides from the load; the launcher starts and drains workers)"
    )
    g.add_argument(
        "--autoscale",
        metavar="POOL=MIN..MAX,...",
        default=None,
        help="scale these pools (prefill, decode) between their bounds, e.g. prefill=1..3,"
        "decode=1..2; each starts at its lower bound (--prefill/--decode count for the others). "
        "Agg mode: decode only; not with DEP instances",
    )
    for name, what in AUTOSCALE_SETTINGS:
        g.add_argument(
            "--autoscale-" + name.replace("_", "-"),
            type=float,
            default=None,
            help=f"{what} (default: the gateway's)",
        )
    g.add_argument(
        "--autoscale-drain-s",
        type=float,
        default=DEFAULT_AUTOSCALE_DRAIN_S,
        help="how long a worker the autoscaler stops may finish its requests (it stops as soon "
        "as it is idle; what still runs then goes on on another rank)",
    )


def autoscale_bounds(args: argparse.Namespace) -> dict[str, PoolBounds] | None:
    """--autoscale parsed (ValueError when it does not parse), None without it."""
    return parse_bounds(args.autoscale) if args.autoscale else None


def eplb_argv(args: argparse.Namespace) -> tuple[str, ...]:
    """The controller's options among `pdmesh up`'s, as its own flags."""
    argv: tuple[str, ...] = ("--no-rebalance",) if args.no_eplb else ()
    for flag, value in (
        ("--eplb-window-steps", args.eplb_window_steps),
        ("--eplb-step-interval", args.eplb_step_interval),
    ):
        argv += (flag, str(value)) if value is not None else ()
    return argv


def gateway_argv(args: argparse.Namespace) -> tuple[str, ...]:
    """The routing and queue options given, as gateway arguments (the gateway checks them)."""
    argv: tuple[str, ...] = ()
    names = ("prefill_routing", "local_prefill_tokens", "decode_balance", "max_queued")
    settings = tuple("autoscale_" + name for name, _ in AUTOSCALE_SETTINGS)
    for name in (*names, "max_queue_wait_s", "api_keys_file", "queue_timeout_s", *settings):
        value = getattr(args, name, None)
        if value is not None:
            argv += ("--" + name.replace("_", "-"), str(value))
    return argv


def run(args: argparse.Namespace) -> int:
    from pdmesh.launcher import Mesh

    worker_engine_config(args)  # bad engine or speculation flags fail here, before anything starts
    bounds = autoscale_bounds(args)
    start_at = {pool: b.min_replicas for pool, b in (bounds or {}).items()}
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdmesh-logs-"))
    options = MeshOptions(
        model_dir=resolve_model(args.model),
        num_prefill=start_at.get("prefill", args.prefill),
        num_decode=start_at.get("decode", args.decode),
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
        gateway_args=gateway_argv(args),
        restart_policy=RestartPolicy(max_restarts=args.max_restarts),
        mesh_token=os.environ.get(MESH_TOKEN_ENV, ""),  # "": the launcher makes one
        api_key=args.api_key,
        worker_nice=args.worker_nice,
        autoscale=bounds,
    )
    if args.torch_threads is None:  # worker ranks share this machine's cores (at most of them)
        args.torch_threads = max(1, (os.cpu_count() or 1) // max_worker_processes(options))
    drain = ("--drain-s", f"{args.autoscale_drain_s:g}") if bounds else ()
    options = replace(options, worker_args=(*engine_argv(args), *drain))
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    say(f"pdmesh up: model {options.model_dir}, mode {options.mode}, logs in {log_dir}")
    signal.signal(signal.SIGTERM, _interrupt)
    mesh = Mesh(options)
    try:
        mesh.start(timeout_s=args.startup_timeout, progress=say)
        mesh.start_supervisor()
        _print_ready(options)
        name = None
        while name is None:  # short waits: Ctrl-C and SIGTERM get through
            name = mesh.wait_gave_up(1.0)
        say(f"pdmesh up: giving up on {name}; stopping the mesh\n--- {name} ---")
        say(mesh.log_tail(name))
        return 1
    except KeyboardInterrupt:
        say("pdmesh up: stopping")
        return 0
    finally:
        mesh.stop()
        say(f"pdmesh up: stopped; {restart_summary(mesh.restarts)}")


def max_worker_processes(options: MeshOptions) -> int:
    """Engine processes of the mesh at its largest (autoscaled pools at their upper bounds)."""
    bounds = options.autoscale or {}
    largest = replace(
        options,
        num_prefill=bounds["prefill"].max_replicas if "prefill" in bounds else options.num_prefill,
        num_decode=bounds["decode"].max_replicas if "decode" in bounds else options.num_decode,
    )
    return max(1, largest.num_worker_processes)


def restart_summary(restarts: dict[str, int]) -> str:
    """One line on what restarted during the run."""
    if not restarts:
        return "no restarts"
    return "restarts: " + ", ".join(f"{name} {count}" for name, count in sorted(restarts.items()))


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops the mesh the same way Ctrl-C does."""
    raise KeyboardInterrupt


def _print_ready(options) -> None:
    base = f"http://{options.host}:{options.http_port}"
    body = f'{{"model": "{options.model_dir.name}", "prompt": "Hello", "max_tokens": 16}}'
    auth = f' -H "Authorization: Bearer ${API_KEY_ENV}"' if options.api_key else ""
    curl = f"curl -s {base}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'"
    key = "\n  API key      required (Authorization: Bearer <the key>)" if options.api_key else ""
    if options.autoscale:
        pools = ", ".join(f"{pool} {bounds}" for pool, bounds in options.autoscale.items())
        key += f"\n  autoscaling  {pools} (the gateway decides; a line per change below)"
    restarts = options.restart_policy.max_restarts
    supervision = (
        f"a process that exits is restarted (at most {restarts} times per service in "
        f"{options.restart_policy.window_s / 60:g} min)"
        if restarts
        else "a process that exits stops the mesh"
    )
    print(
        f"""
pdmesh is serving {options.model_dir.name}
  OpenAI API   {base}/v1
  gRPC (SDK)   {options.host}:{options.grpc_port}
  mesh view    {base}/mesh
  metrics      {base}/metrics{key}
try:
  {curl}
{supervision}; Ctrl-C stops everything.""",
        flush=True,
    )
