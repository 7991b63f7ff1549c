"""`pdmesh bench kvxfer`: NIXL push throughput between two processes vs a plain in-process memory
copy.

Chain: a receiver process registers a pool `[1, N, 1, 65536]` uint8 with its `KVTransferAgent` and
sends its metadata and layout through a pipe → this process connects and, for each size, times
`write` + `wait` of consecutive blocks (one region: the KV hand-off path, descriptor set-up
included), each repeat followed by the same size copied with `torch` `dst.copy_(src)` (one intra-op
thread: one copy engine on each side) → medians of `--repeats` after `--warmup` → the receiver
confirms the notifications and a checksum of the bytes it got.

JSON: {"results": [{"bytes", "nixl_gbps", "memcpy_gbps", "ratio" (nixl/memcpy, of the medians),
"nixl_us", "memcpy_us", "nixl_best_gbps", "memcpy_best_gbps"}], "notes": [...], "config": {...}};
GB/s are 1e9 bytes/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BLOCK_BYTES = 64 << 10  # one "block" of the bench pool; sizes are whole blocks
DEFAULT_SIZES = "64K,256K,1M,4M,16M,64M"
QUICK_SIZES = "64K,1M,4M"
RECEIVER_NAME, SENDER_NAME = "kvxfer-receiver", "kvxfer-sender"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True)
class Row:
    bytes: int
    nixl_gbps: float
    memcpy_gbps: float
    ratio: float
    nixl_us: float
    memcpy_us: float
    nixl_best_gbps: float  # fastest repeat (the host is shared: the medians carry its noise)
    memcpy_best_gbps: float


def parse_size(text: str) -> int:
    """'64K' → 65536; K/M/G are powers of 1024; the result must be a whole number of 64 KiB
    blocks."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1:] if text[-1:] in _UNITS else ""
    value = int(text[: len(text) - len(unit)]) * _UNITS[unit]
    if value <= 0 or value % BLOCK_BYTES:
        raise ValueError(f"size {text!r} must be a positive multiple of {BLOCK_BYTES >> 10} KiB")
    return value


def _receiver(conn: Any, nbytes: int) -> None:
    """Child process: own the destination pool; on ("stop", expected) report (notifications,
    checksum, transport)."""
    import torch

    from pdmesh_engine.transfer.agent import KVTransferAgent

    pool = torch.zeros(1, nbytes // BLOCK_BYTES, 1, BLOCK_BYTES, dtype=torch.uint8)
    agent = KVTransferAgent(RECEIVER_NAME, pool)
    conn.send((agent.metadata(), agent.layout))
    received = 0
    while not conn.poll(0.01):  # NIXL's progress thread does the work meanwhile
        received += len(agent.notifications())
    _, expected, check_bytes = conn.recv()
    deadline = time.monotonic() + 10
    while received < expected and time.monotonic() < deadline:
        received += len(agent.notifications())
        time.sleep(0.001)
    checksum = int(pool.view(-1)[:check_bytes].sum(dtype=torch.int64))
    conn.send((received, checksum))
    agent.close()


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _measure(agent: Any, layout: Any, source: Any, nbytes: int, repeats: int, warmup: int) -> Row:
    """NIXL push and memcpy of `nbytes`, interleaved repeat by repeat so both see the same host
    load."""
    import torch

    block_ids = list(range(nbytes // BLOCK_BYTES))
    src = source.view(-1)[:nbytes]
    dst = torch.empty_like(src)
    pushes = iter(range(warmup + repeats))

    def push() -> None:
        transfer = agent.write(
            f"kvxfer-{nbytes}-{next(pushes)}", block_ids, RECEIVER_NAME, layout, block_ids
        )
        state = agent.wait(transfer, timeout_s=30)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer of {nbytes} bytes ended {state}")

    nixl, memcpy = [], []
    for i in range(warmup + repeats):
        pair = _timed(push), _timed(lambda: dst.copy_(src))
        if i >= warmup:
            nixl.append(pair[0])
            memcpy.append(pair[1])
    return _row(nbytes, nixl, memcpy)


def _row(nbytes: int, nixl: list[float], memcpy: list[float]) -> Row:
    def gbps(seconds: float) -> float:
        return round(nbytes / seconds / 1e9, 4)

    nixl_s, memcpy_s = statistics.median(nixl), statistics.median(memcpy)
    return Row(
        nbytes,
        gbps(nixl_s),
        gbps(memcpy_s),
        round(memcpy_s / nixl_s, 4),
        round(nixl_s * 1e6, 2),
        round(memcpy_s * 1e6, 2),
        gbps(min(nixl)),
        gbps(min(memcpy)),
    )


def _recv(conn: Any, timeout_s: float, what: str) -> Any:
    if not conn.poll(timeout_s):
        raise RuntimeError(f"kvxfer receiver sent no {what} within {timeout_s:g}s")
    return conn.recv()


def run_bench(
    sizes: list[int], repeats: int, warmup: int, sender_progress_thread: bool = False
) -> tuple[list[Row], list[str]]:
    """Both measurements for every size, in one run; raises RuntimeError if the receiver saw other
    bytes."""
    import multiprocessing as mp

    import torch

    from pdmesh_engine.transfer.agent import KVTransferAgent

    threads, largest = torch.get_num_threads(), max(sizes)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    receiver = ctx.Process(target=_receiver, args=(child, largest), daemon=True)
    receiver.start()
    source = torch.randint(0, 256, (1, largest // BLOCK_BYTES, 1, BLOCK_BYTES), dtype=torch.uint8)
    agent = KVTransferAgent(SENDER_NAME, source, progress_thread=sender_progress_thread)
    try:
        torch.set_num_threads(1)
        metadata, layout = _recv(conn, 120, "metadata")
        agent.connect(RECEIVER_NAME, metadata)
        rows = [_measure(agent, layout, source, n, repeats, warmup) for n in sizes]
        conn.send(("stop", agent.num_transfers, largest))
        received, checksum = _recv(conn, 30, "report")
        expected = int(source.view(-1)[:largest].sum(dtype=torch.int64))
        if received != agent.num_transfers or checksum != expected:
            raise RuntimeError(
                f"receiver saw {received}/{agent.num_transfers} notifications, "
                f"checksum {checksum} != {expected}"
            )
    finally:
        torch.set_num_threads(threads)
        agent.close()
        receiver.join(15)
        if receiver.is_alive():
            receiver.kill()
    return rows, _notes(agent.num_transfers, largest, repeats, warmup, sender_progress_thread)


def _notes(
    transfers: int, largest: int, repeats: int, warmup: int, sender_progress_thread: bool
) -> list[str]:
    tls = os.environ.get(
        "UCX_TLS", "(unset: UCX picks; same host: cma for data, tcp/lo for notifications)"
    )
    sender = (
        "progress thread"
        if sender_progress_thread
        else "polls (a prefill agent needs no progress thread)"
    )
    return [
        f"UCX_TLS={tls}",
        f"{transfers} transfers, all notified; receiver checksum of {largest} bytes matches",
        f"receiver: NIXL progress thread; sender: {sender}",
        "nixl time = write() (plan + descriptors + post) until wait() sees DONE; memcpy = torch "
        "copy_, 1 thread",
        f"median of {repeats} after {warmup} warm-up, nixl and memcpy interleaved; "
        f"host {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at the end (shared: expect "
        "noise)",
    ]


def format_table(rows: list[Row]) -> str:
    lines = [
        f"{'size':>10} {'nixl GB/s':>10} {'memcpy GB/s':>12} {'ratio':>7} {'nixl us':>10} "
        f"{'memcpy us':>10}"
        f" {'best nixl':>10} {'best memcpy':>12}"
    ]
    for r in rows:
        size = f"{r.bytes >> 20}M" if r.bytes >= 1 << 20 else f"{r.bytes >> 10}K"
        lines.append(
            f"{size:>10} {r.nixl_gbps:>10.2f} {r.memcpy_gbps:>12.2f} {r.ratio:>7.2f} "
            f"{r.nixl_us:>10.1f} {r.memcpy_us:>10.1f} {r.nixl_best_gbps:>10.2f} "
            f"{r.memcpy_best_gbps:>12.2f}"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes",
        default=None,
        help=f"comma-separated sizes (default {DEFAULT_SIZES}; --quick: {QUICK_SIZES})",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed transfers per size (default 20; --quick: 5)",
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed transfers first (default 3; --quick: 2)"
    )
    p.add_argument("--quick", action="store_true", help="few sizes and repeats (a smoke run)")
    p.add_argument(
        "--ucx-tls", default=None, help="set UCX_TLS for both processes (e.g. cma,tcp or tcp)"
    )
    p.add_argument(
        "--sender-progress-thread",
        action="store_true",
        help="run NIXL's progress thread in the sender too (slower on few cores; see notes)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")


def run(args: argparse.Namespace) -> int:
    sizes = [
        parse_size(s)
        for s in (args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)).split(",")
    ]
    repeats = args.repeats or (5 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    if repeats < 1 or warmup < 0:
        raise ValueError("--repeats must be >= 1 and --warmup >= 0")
    if args.ucx_tls:
        # read by UCX when each agent starts; children inherit it
        os.environ["UCX_TLS"] = args.ucx_tls
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # both agents on loopback, as the local services
    rows, notes = run_bench(sizes, repeats, warmup, args.sender_progress_thread)
    print(format_table(rows))
    for note in notes:
        print(f"# {note}")
    if args.json:
        report = {
            "results": [asdict(r) for r in rows],
            "notes": notes,
            "config": {
                "sizes": sizes,
                "repeats": repeats,
                "warmup": warmup,
                "block_bytes": BLOCK_BYTES,
            },
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("kvxfer", help="NIXL KV push between two processes vs memcpy")
    add_arguments(p)
    p.set_defaults(run=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdmesh bench kvxfer",
        description=__doc__.split("\n\n")[0],  # the summary paragraph
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
