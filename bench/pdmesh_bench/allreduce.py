"""`pdmesh bench allreduce`: the per-step DP sync, gloo's ring `all_reduce` vs our recursive
doubling.

For each world size p of `--ranks`: p spawned processes join a gloo group on loopback (the
rendezvous store is this process's, on 127.0.0.1 and a port the OS picks, so runs never collide) →
every rank checks that both implementations give the closed-form sum of distinct contributions →
`--warmup` untimed calls of each → `--repeats` timed calls of each, in alternating blocks of `BLOCK`
calls (which one goes first flips every block), so both see the same drift of a shared host.

Method: calls run back to back, as the engine's steps do (no barrier between them: a barrier would
add its own latency and the skew with which ranks leave it); rank 0 times each call with
`perf_counter_ns`. An all-reduce cannot finish on any rank before every rank has entered it, so
back-to-back per-call times on one rank are the steady-state latency of the sync; the tensor is
refilled (untimed) before each call. p50 and p90 are over those calls, in microseconds.

`--spin-cpus N` runs N busy loops at nice 19 during the measurement (a diagnostic, off by default):
on a VM whose idle vCPUs halt, a rank blocked in a point-to-point wait can pay the host's vCPU
wake-up latency (seen on a 2-vCPU VM: a ~4 ms floor per exchange at 2 ranks, gone with the cores
kept busy), while gloo's collective path keeps its event-loop thread polling and does not; a loaded
serving host is the busy case.

JSON: {"results": [{"ranks", "gloo_us_p50", "gloo_us_p90", "ours_us_p50", "ours_us_p90", "ratio"
(gloo p50 / ours p50), "ours_rounds", "gloo_us_mean", "ours_us_mean"}], "notes": [...], "config":
{...}}.

`run_ranks` (spawn p ranks in a loopback gloo group, return what each rank's function returns) is
also what the tests use.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdmesh_engine.parallel.allreduce import make_dp_sync, num_rounds

LOOPBACK = "127.0.0.1"
BLOCK = 25  # timed calls of one implementation before switching to the other
DEFAULT_RANKS, QUICK_RANKS = "2,4,8,16", "2,3"


def _loopback_ifname() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next(
        (n for n in names if n == "lo"), next((n for n in names if n.startswith("lo")), None)
    )


def _rank_main(
    target: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    results: Any,
    args: tuple[Any, ...],
    timeout_s: float,
) -> None:
    """Child process: join the group, run `target(rank, world, *args)`, put (rank, ok, value or
    traceback)."""
    ifname = _loopback_ifname()
    if ifname:
        # gloo binds the loopback device, not the hostname's
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    torch.set_num_threads(1)
    try:
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(LOOPBACK, port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        try:
            value = target(rank, world, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))


def _stop(processes: list[Any], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(5)


def _collect(results: Any, processes: list[Any], world: int, timeout_s: float) -> list[Any]:
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(values) < world:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue_mod.Empty:
            dead = [i for i, p in enumerate(processes) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                why = f"ranks {dead} died" if dead else f"timed out after {timeout_s:.0f}s"
                raise RuntimeError(f"{why}; {len(values)}/{world} ranks reported") from None
            continue
        if not ok:
            raise RuntimeError(f"rank {rank} of {world} failed:\n{value}")
        values[rank] = value
    return [values[r] for r in range(world)]


def run_ranks(
    world: int, target: Callable[..., Any], args: tuple[Any, ...] = (), timeout_s: float = 300.0
) -> list[Any]:
    """Run `target(rank, world, *args)` in `world` spawned processes joined in a gloo group on
    loopback.

    `target` must be importable by name (a module-level function); children use one torch thread.
    Returns the values by rank; raises RuntimeError with the child's traceback if a rank fails.
    """
    store = dist.TCPStore(
        LOOPBACK, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    processes = [
        ctx.Process(
            target=_rank_main,
            args=(target, rank, world, store.port, results, args, timeout_s),
            daemon=True,
        )
        for rank in range(world)
    ]
    for p in processes:
        p.start()
    try:
        values = _collect(results, processes, world, timeout_s)
    except BaseException:
        _stop(processes, 0.0)
        raise
    _stop(processes, 30.0)
    del store  # kept alive until every rank is done with it
    return values


def _verify(rank: int, world: int, elements: int, syncs: dict[str, Any]) -> None:
    """Both implementations must give the closed-form sum of contributions [rank + 1 + j * rank]."""
    j = torch.arange(elements, dtype=torch.int64)
    expected = world * (world + 1) // 2 + j * (world * (world - 1) // 2)
    for name, sync in syncs.items():
        tensor = 1 + rank + j * rank
        sync.all_reduce(tensor)
        if not torch.equal(tensor, expected):
            raise RuntimeError(f"{name} on {world} ranks: {tensor.tolist()} != {expected.tolist()}")


def bench_rank(
    rank: int, world: int, elements: int, repeats: int, warmup: int
) -> dict[str, Any] | None:
    """One rank of the benchmark; rank 0 returns its per-call times (ns) of both implementations."""
    syncs = {"gloo": make_dp_sync("gloo"), "ours": make_dp_sync("recursive_doubling")}
    _verify(rank, world, elements, syncs)
    source = torch.arange(elements, dtype=torch.int64) + rank
    tensor = torch.empty_like(source)
    for sync in syncs.values():
        for _ in range(warmup):
            tensor.copy_(source)
            sync.all_reduce(tensor)
    times: dict[str, list[int]] = {name: [] for name in syncs}
    order = list(syncs)
    while len(times["ours"]) < repeats:
        n = min(BLOCK, repeats - len(times["ours"]))
        for name in order:  # every rank runs the same sequence of calls
            sync, record = syncs[name], times[name]
            for _ in range(n):
                tensor.copy_(source)
                start = time.perf_counter_ns()
                sync.all_reduce(tensor)
                record.append(time.perf_counter_ns() - start)
        order.reverse()
    return {"times_ns": times, "rounds": syncs["ours"].rounds} if rank == 0 else None


@dataclass(frozen=True)
class Row:
    ranks: int
    gloo_us_p50: float
    gloo_us_p90: float
    ours_us_p50: float
    ours_us_p90: float
    ratio: float  # gloo p50 / ours p50: > 1 means ours is faster
    ours_rounds: int
    gloo_us_mean: float
    ours_us_mean: float


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def measure(world: int, elements: int, repeats: int, warmup: int) -> Row:
    report = run_ranks(world, bench_rank, (elements, repeats, warmup))[0]
    us = {name: [t / 1000.0 for t in ns] for name, ns in report["times_ns"].items()}
    stats = {
        name: (percentile(v, 50), percentile(v, 90), sum(v) / len(v)) for name, v in us.items()
    }
    if report["rounds"] != num_rounds(world):
        raise RuntimeError(
            f"{report['rounds']} rounds on {world} ranks, expected {num_rounds(world)}"
        )
    return Row(
        world,
        *stats["gloo"][:2],
        *stats["ours"][:2],
        stats["gloo"][0] / stats["ours"][0],
        report["rounds"],
        stats["gloo"][2],
        stats["ours"][2],
    )


def format_table(rows: list[Row]) -> str:
    lines = [
        f"{'ranks':>5} {'gloo p50 us':>12} {'gloo p90 us':>12} {'ours p50 us':>12} "
        f"{'ours p90 us':>12}"
        f" {'gloo/ours':>9} {'rounds':>6}"
    ]
    for r in rows:
        lines.append(
            f"{r.ranks:>5} {r.gloo_us_p50:>12.1f} {r.gloo_us_p90:>12.1f} {r.ours_us_p50:>12.1f}"
            f" {r.ours_us_p90:>12.1f} {r.ratio:>9.2f} {r.ours_rounds:>6}"
        )
    return "\n".join(lines)


def _notes(ranks: list[int], elements: int, repeats: int, warmup: int, spin_cpus: int) -> list[str]:
    cpus = os.cpu_count() or 1
    over = [p for p in ranks if p > cpus]
    return [
        f"host {cpus} CPUs: "
        + (
            f"runs with {over} ranks are oversubscribed (more processes than cores), "
            "so their times are dominated by OS scheduling, not the network"
            if over
            else "no run is oversubscribed"
        ),
        f"int64 tensor of {elements} elements (the DP-sync size); sum; gloo on loopback, one torch "
        "thread",
        f"rank 0 times each of {repeats} back-to-back calls per implementation after {warmup} "
        "warm-up "
        f"calls, in alternating blocks of {BLOCK}; no barrier between calls",
        "ratio = gloo p50 / ours p50 (> 1: recursive doubling is faster); ours_rounds = message "
        "rounds, "
        "log2(p) or floor(log2(p)) + 2",
        f"{spin_cpus} nice-19 busy loops ran meanwhile"
        + (
            " (CPUs kept awake; see the module doc)"
            if spin_cpus
            else "; on a VM, idle vCPUs may halt: see --spin-cpus"
        ),
        f"load average {os.getloadavg()[0]:.1f} at the end (shared host: expect noise)",
    ]


def start_spinners(n: int) -> list[subprocess.Popen]:
    """n busy-loop processes at the lowest priority (they yield to the ranks but keep the CPUs
    awake)."""
    code = "import os\nos.nice(19)\nwhile True:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def stop_spinners(spinners: list[subprocess.Popen]) -> None:
    for proc in spinners:
        proc.kill()
        proc.wait(10)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ranks",
        default=None,
        help=f"comma-separated world sizes (default {DEFAULT_RANKS}; --quick: {QUICK_RANKS})",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed calls per implementation (default 200; --quick: 20)",
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed calls first (default 20; --quick: 5)"
    )
    p.add_argument(
        "--elements", type=int, default=8, help="int64 elements all-reduced (default %(default)s)"
    )
    p.add_argument(
        "--spin-cpus",
        type=int,
        default=0,
        help="run N nice-19 busy loops meanwhile, so idle vCPUs do not halt (diagnostic; default "
        "0)",
    )
    p.add_argument("--quick", action="store_true", help="few ranks and repeats (a smoke run)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("allreduce", help="DP sync: gloo all_reduce vs recursive doubling")
    add_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    ranks = [
        int(x) for x in (args.ranks or (QUICK_RANKS if args.quick else DEFAULT_RANKS)).split(",")
    ]
    repeats = args.repeats or (20 if args.quick else 200)
    warmup = args.warmup if args.warmup is not None else (5 if args.quick else 20)
    if min(ranks) < 1 or repeats < 1 or warmup < 0 or args.elements < 1 or args.spin_cpus < 0:
        raise ValueError(
            "--ranks and --elements must be >= 1, --repeats >= 1, --warmup and --spin-cpus >= 0"
        )
    spinners = start_spinners(args.spin_cpus)
    try:
        rows = [measure(p, args.elements, repeats, warmup) for p in ranks]
    finally:
        stop_spinners(spinners)
    notes = _notes(ranks, args.elements, repeats, warmup, args.spin_cpus)
    print(format_table(rows))
    for note in notes:
        print(f"# {note}")
    if args.json is not None:
        config = {
            "ranks": ranks,
            "repeats": repeats,
            "warmup": warmup,
            "elements": args.elements,
            "block": BLOCK,
            "spin_cpus": args.spin_cpus,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"results": [asdict(r) for r in rows], "notes": notes, "config": config}, indent=2
            )
            + "\n"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdmesh bench allreduce",
        description=__doc__.split("\n\n")[0],  # the summary paragraph
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
