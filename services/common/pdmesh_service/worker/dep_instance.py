"""DEP instances of the worker services: `pdmesh serve prefill|decode --dep N` runs N rank
processes.

The process started with `--dep N` (N > 1, no `--dep-rank`) supervises the instance: it checks that
the routed experts split evenly over the ranks (before anything starts), resolves the ports, then
starts one child per rank, `pdmesh serve ROLE <the same options> --port BASE --dist-port P
--dep-rank r`, and waits. Rank r (`rank_common`):
  - serves gRPC on BASE + r (Prometheus on --metrics-port + r when given) and registers as its own
    routable instance `<id>-r<r>` (id: --instance-id, else ROLE-BASE) with rank=r, dp_size=N, and
    its own NIXL agent of that name;
  - joins the instance's gloo group at tcp://HOST:P (HOST: the bind host; loopback for a wildcard).
Contracts: SIGTERM/SIGINT to the supervisor stops every rank (their engine loops leave the lockstep
at the same step) and it exits 0; a rank that exits on its own stops the instance (the other ranks'
collectives break: each logs one line, leaves the registry and exits 1): the supervisor waits
SETTLE_S for that, SIGTERMs what is left, SIGKILLs it after STOP_GRACE_S, and exits 1, so that
whoever started it (`pdmesh up`'s launcher) restarts the instance as a whole, on the same ports.
Ranks get SIGKILL when the supervisor dies (PR_SET_PDEATHSIG), so no rank outlives it.

Elastic (`--dep-elastic`, pdmesh_engine.parallel.elastic): a rank that exits does not stop the
instance. The survivors re-form their group without it (records under a per-run key in the
deployment's Redis, `worker.elastic_store`) and keep serving; the supervisor restarts that rank
alone, after `REJOIN_DELAY_S`, with `--dep-rejoin`: it builds its engine, asks to join, and the
group grows back at a step boundary. The instance stops (exit 1) only when every rank exited.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from pdmesh_engine.parallel.allreduce import DP_SYNC_IMPLS
from pdmesh_engine.parallel.dep import check_dep_choices
from pdmesh_service.logging import configure_logging, get_logger
from pdmesh_service.options import CommonConfig
from pdmesh_service.process import die_with_parent
from pdmesh_service.redis_server import PortPicker, free_port_block

log = get_logger(__name__)
STOP_GRACE_S = 8.0  # below the launcher's 10 s, so the supervisor kills what is left itself
SETTLE_S = 2.0  # after a rank died: how long the others get to leave on their own (group broke)
WATCH_INTERVAL_S = 0.5
REJOIN_DELAY_S = 1.0  # an elastic instance's exited rank is restarted (to rejoin) after this
WILDCARD_HOSTS = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class DEPOptions:
    """How a worker process takes part in a DEP instance (size 1: a plain single-rank worker)."""

    size: int = 1
    rank: int | None = None  # None: supervise `size` ranks (size > 1) or run the only one
    dist_port: int = 0  # the group's rendezvous port; 0: the supervisor picks one
    # the per-step all-reduce (pdmesh_engine.parallel.allreduce)
    dp_sync: str = "recursive_doubling"
    num_redundant_experts: int = 0  # extra physical expert slots per MoE layer
    # a rank's EPLB agent reports loads this often; 0: no EPLB on the ranks
    eplb_report_s: float = 1.0
    dist_host: str = ""  # rank 0's address when ranks run on different hosts (one rank per pod)
    elastic: bool = False  # survivors of a lost rank re-form the group and keep serving
    rejoin: bool = False  # a restarted rank of an elastic instance: join the running group
    run_id: str = ""  # names this run's group records (set by the supervisor)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"--dep must be >= 1, got {self.size}")
        if self.rank is not None and not 0 <= self.rank < self.size:
            raise ValueError(f"--dep-rank must be in [0, {self.size}), got {self.rank}")
        if self.rank is not None and self.size > 1 and not self.dist_port:
            raise ValueError(
                "--dep-rank needs --dist-port (the port every rank of the instance meets on)"
            )
        if not 0 <= self.dist_port < 65536:
            raise ValueError(f"--dist-port must be in [0, 65535], got {self.dist_port}")
        check_dep_choices(
            self.dp_sync, self.num_redundant_experts, "--dp-sync", "--num-redundant-experts"
        )
        if self.num_redundant_experts and self.size == 1:
            raise ValueError("--num-redundant-experts needs --dep > 1")
        if self.dist_host and self.rank is None:
            raise ValueError(
                "--dist-host is for rank processes started one per host: it needs --dep-rank"
            )
        if self.rejoin and not (self.elastic and self.rank is not None):
            raise ValueError("--dep-rejoin is for a rank (--dep-rank) of a --dep-elastic instance")
        if not self.eplb_report_s >= 0:
            raise ValueError(f"--eplb-report-s must be >= 0 (0: off), got {self.eplb_report_s}")

    @property
    def is_supervisor(self) -> bool:
        return self.size > 1 and self.rank is None

    @property
    def is_rank(self) -> bool:
        return self.size > 1 and self.rank is not None


def add_dep_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("DEP (data-parallel attention + expert parallelism)")
    g.add_argument(
        "--dep",
        type=int,
        default=1,
        help="ranks of this instance: N processes, each its own routable endpoint (ports "
        "PORT..PORT+N-1)"
        " holding 1/N of the routed experts",
    )
    g.add_argument(
        "--num-redundant-experts",
        type=int,
        default=0,
        help="extra expert slots per MoE layer; experts + redundant must be a multiple of --dep",
    )
    g.add_argument(
        "--dp-sync",
        default="recursive_doubling",
        choices=sorted(DP_SYNC_IMPLS),
        help="the per-step all-reduce that keeps the ranks in lockstep",
    )
    g.add_argument(
        "--dist-port", type=int, default=0, help="the ranks' rendezvous port (default: a free one)"
    )
    g.add_argument(
        "--dep-rank", type=int, default=None, help="run only this rank (set by the supervisor)"
    )
    g.add_argument(
        "--eplb-report-s",
        type=float,
        default=1.0,
        help="each rank reports its expert loads to the EPLB controller (and picks up new "
        "placements)"
        " this often; 0: EPLB off on this instance",
    )
    g.add_argument(
        "--dist-host",
        default="",
        help="rank 0's address, for ranks started one per host with --dep-rank (e.g. Kubernetes "
        "pods);"
        " each rank then keeps --port and --metrics-port as given",
    )
    g.add_argument(
        "--dep-elastic",
        action="store_true",
        help="when a rank dies the others re-form the group without it and keep serving; the "
        "rank is restarted alone and joins again (its DP sync is then an all-to-all)",
    )
    g.add_argument("--dep-rejoin", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--dep-run-id", default="", help=argparse.SUPPRESS)


def dep_from_args(args: argparse.Namespace) -> DEPOptions:
    return DEPOptions(
        args.dep,
        args.dep_rank,
        args.dist_port,
        args.dp_sync,
        args.num_redundant_experts,
        args.eplb_report_s,
        args.dist_host,
        args.dep_elastic,
        args.dep_rejoin,
        args.dep_run_id,
    )


def master_addr(host: str, dist_host: str = "") -> str:
    """Where the ranks meet: --dist-host (rank 0's address, ranks on several hosts), else the bind
    host, loopback when that is a wildcard (all ranks on this host)."""
    if dist_host:
        return dist_host
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


def rank_common(common: CommonConfig, role: str, dep: DEPOptions) -> CommonConfig:
    """The service options of this process (pure): unchanged unless it is a DEP rank r, which gets
    port BASE + r, metrics port + r and id `<id>-r<r>` (with --dist-host, one rank per host: only
    the id). Without --port or --instance-id (a rank started by hand) a rank takes any free port and
    the id ROLE-PORT."""
    rank = dep.rank
    if not dep.is_rank or rank is None:  # is_rank implies a rank; the check narrows its type
        return common
    base_id = common.instance_id or (f"{role}-{common.port}" if common.port else "")
    instance_id = f"{base_id}-r{rank}" if base_id else ""
    if dep.dist_host:  # one rank per host (a pod): its ports are the ones given
        return replace(common, instance_id=instance_id)
    return replace(
        common,
        port=common.port + rank if common.port else 0,
        instance_id=instance_id,
        metrics_port=None if common.metrics_port is None else common.metrics_port + rank,
    )


def check_expert_split(model_dir: Path, dep: DEPOptions) -> None:
    """ValueError with what to change when the experts' slots do not split evenly over the ranks."""
    from pdmesh_engine.model.configs import read_model_config
    from pdmesh_engine.parallel.dep import slots_of_rank

    config = read_model_config(model_dir)
    if config.moe_layer_ids:
        slots_of_rank(config.n_routed_experts, dep.num_redundant_experts, dep.size, 0)


def rank_argv(
    role: str,
    options: list[str],
    rank: int,
    base_port: int,
    dist_port: int,
    run_id: str = "",
    rejoin: bool = False,
) -> list[str]:
    """The command line of one rank: the supervisor's options, then what pins this rank (the last
    wins); an elastic instance's run id, and `--dep-rejoin` for a restarted rank."""
    elastic = [*(["--dep-run-id", run_id] if run_id else []), *(["--dep-rejoin"] if rejoin else [])]
    return [
        sys.executable,
        "-m",
        f"pdmesh_{role}",
        *options,
        "--port",
        str(base_port),
        "--dist-port",
        str(dist_port),
        "--dep-rank",
        str(rank),
        *elastic,
    ]


def run_instance(
    role: str, options: list[str], common: CommonConfig, model_dir: Path, dep: DEPOptions
) -> int:
    """Supervise a DEP instance until SIGTERM/SIGINT (exit 0) or until a rank exits (the others
    are stopped; exit 1)."""
    check_expert_split(model_dir, dep)
    configure_logging(role, common.log_level)
    base = common.port or free_port_block(common.host, dep.size)
    metrics = common.metrics_port
    taken = [*range(base, base + dep.size)]
    taken += [*range(metrics, metrics + dep.size)] if metrics is not None else []
    # not one of the ranks' own ports, which they bind only after the rendezvous port is taken
    dist_port = dep.dist_port or PortPicker(master_addr(common.host), taken=taken).block()
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    ranks: list[subprocess.Popen[bytes]] = []
    failed: list[int] = []
    run_id = f"{os.getpid()}-{time.time_ns()}" if dep.elastic else ""

    def start(rank: int, rejoin: bool = False) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            rank_argv(role, options, rank, base, dist_port, run_id, rejoin),
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent(signal.SIGKILL),
        )

    try:
        ranks.extend(start(rank) for rank in range(dep.size))
        addresses = [common.address(base + rank) for rank in range(dep.size)]
        log.info(
            "DEP instance started",
            ranks=addresses,
            dist_port=dist_port,
            pids=[p.pid for p in ranks],
        )
        failed = _watch_elastic(ranks, stopping, start) if dep.elastic else _watch(ranks, stopping)
        if failed:
            log.error(
                "a rank exited; stopping the DEP instance",
                exited={rank: ranks[rank].returncode for rank in failed},
            )
    finally:
        # the others saw their collectives break: let them leave on their own first
        _stop(ranks, STOP_GRACE_S, SETTLE_S if failed else 0.0)
    if not failed:
        log.info("DEP instance stopped")
        return 0
    log.error("DEP instance stopped", codes=[p.returncode for p in ranks])
    return 1


def _watch(ranks: list[subprocess.Popen[bytes]], stopping: threading.Event) -> list[int]:
    """Wait for a stop signal (empty) or for ranks to exit (the indexes of those that did)."""
    while not stopping.wait(WATCH_INTERVAL_S):
        exited = [rank for rank, process in enumerate(ranks) if process.poll() is not None]
        if exited:
            return exited
    return []


def _watch_elastic(
    ranks: list[subprocess.Popen[bytes]],
    stopping: threading.Event,
    start: Callable[[int, bool], subprocess.Popen[bytes]],
) -> list[int]:
    """`_watch` of an elastic instance: a rank that exits is restarted alone (it rejoins the
    group) after `REJOIN_DELAY_S`; every rank exited (the group is gone): their indexes."""
    restart_at: dict[int, float] = {}
    while not stopping.wait(WATCH_INTERVAL_S):
        now = time.monotonic()
        for rank, process in enumerate(ranks):
            if process.poll() is None or rank in restart_at:
                continue
            if all(p.poll() is not None for p in ranks):
                return list(range(len(ranks)))
            log.warning(
                "a rank exited; the others go on, it rejoins", rank=rank, code=process.returncode
            )
            restart_at[rank] = now + REJOIN_DELAY_S
        for rank, at in list(restart_at.items()):
            if now >= at:
                del restart_at[rank]
                ranks[rank] = start(rank, True)
                log.info("rank restarted to rejoin", rank=rank, pid=ranks[rank].pid)
    return []


def _stop(ranks: list[subprocess.Popen[bytes]], grace_s: float, settle_s: float = 0.0) -> None:
    """After up to `settle_s` for the ranks to exit on their own, SIGTERM every live rank (they stop
    together), SIGKILL what is left after `grace_s`."""
    settled = time.monotonic() + settle_s
    while time.monotonic() < settled and any(p.poll() is None for p in ranks):
        time.sleep(0.05)
    for process in ranks:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in ranks:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
