"""What `pdmesh bench soak` reads of a running mesh, and its plot.

`Watch.sample()` → `soak_core.Sample`: for every service of the mesh (and its embedded Redis) the
RSS (VmRSS of /proc/PID/status) and open fds (/proc/PID/fd) summed over its process tree, each
worker rank's KV blocks held (`Status`, sent with the mesh token), Redis DBSIZE and keys per kind
(SCAN), the gateway's `pdmesh_requests_in_flight`. `drain_handoffs()`: at the end, until no
hand-off record is left (or a deadline), then what is left. `print_report`: the table;
`write_plot`: the series (matplotlib, headless, imported only then).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import redis.asyncio as aioredis

from pdmesh.supervisor import REDIS
from pdmesh_bench.chaos_core import counter_total
from pdmesh_bench.chaos_mesh import MeshControl
from pdmesh_bench.soak_core import (
    CATEGORIES,
    HANDOFF_PREFIX,
    Answer,
    Sample,
    key_prefix,
    redis_leftovers,
)
from pdmesh_kvstore.server import KVStoreConfig
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2_grpc
from pdmesh_proto.prefill.v1 import prefill_pb2_grpc
from pdmesh_service.grpc_server import channel
from pdmesh_service.handoff import HandoffState
from pdmesh_service.registry import namespace

IN_FLIGHT = "pdmesh_requests_in_flight"
# how long the kvstore keeps a finished hand-off record (its --handoff-retention-s default)
RETENTION_MS = int(KVStoreConfig.handoff_retention_s * 1000)


# ----- processes -------------------------------------------------------------------------------


def children_of() -> dict[int, list[int]]:
    """ppid → its children's pids, over every process /proc shows now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after "(comm)": state, ppid, ...
        children.setdefault(ppid, []).append(int(entry))
    return children


def tree_of(pid: int, children: dict[int, list[int]]) -> list[int]:
    """pid and all its descendants."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def rss_kb(pid: int) -> int:
    """VmRSS of a process in kB (0: gone or a kernel thread)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def num_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


# ----- the mesh --------------------------------------------------------------------------------


@dataclass
class Watch:
    control: MeshControl
    url: str  # the gateway's base URL
    client: httpx.AsyncClient
    redis: aioredis.Redis = field(init=False)

    def __post_init__(self) -> None:
        mesh = self.control.mesh
        self.redis = aioredis.Redis.from_url(
            mesh.redis_url, socket_timeout=5.0, socket_connect_timeout=5.0
        )
        self.namespace = namespace(mesh.options.deployment)

    async def close(self) -> None:
        await self.redis.aclose()

    async def sample(self, t: float, phase: str, num_ended: int) -> Sample:
        sample = Sample(t, phase, num_ended=num_ended)
        self._processes(sample)
        for key, role, address in self.control.worker_ranks():
            status = await self._status(role, address)
            if status is not None:
                sample.blocks[key] = int(status.kv_blocks_used)
                sample.requests[key] = (int(status.num_running), int(status.num_waiting))
        try:
            sample.redis_keys = int(await self.redis.dbsize())
            sample.redis_prefixes = await self.redis_prefixes()
        except (aioredis.RedisError, OSError):
            pass
        sample.in_flight = await self._in_flight()
        return sample

    async def sample_every(
        self,
        interval_s: float,
        now: Callable[[], float],
        phase: list[str],
        answers: list[Answer],
        samples: list[Sample],
    ) -> None:
        """A sample every interval_s (phase[0] names the phase) until cancelled."""
        while True:
            started = time.monotonic()
            samples.append(await self.sample(now(), phase[0], len(answers)))
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))

    def _processes(self, sample: Sample) -> None:
        mesh = self.control.mesh
        children = children_of()
        for name in [s.name for s in mesh.specs] + mesh.names(REDIS):
            pid = mesh.pid_of(name)
            if pid is None:
                continue
            tree = tree_of(pid, children)
            sample.pids[name] = pid
            sample.rss_mb[name] = sum(rss_kb(p) for p in tree) / 1024
            sample.fds[name] = sum(num_fds(p) for p in tree)

    async def _status(self, role: str, address: str) -> Any:
        stub_class = (
            decode_pb2_grpc.DecodeStub if role == "decode" else prefill_pb2_grpc.PrefillStub
        )
        async with channel(address, self.control.auth) as ch:
            try:
                status = await stub_class(ch).Status(common_pb2.StatusRequest(), timeout=10.0)
            except grpc.RpcError:
                return None
        return status

    async def _in_flight(self) -> float | None:
        try:
            response = await self.client.get(f"{self.url}/metrics", timeout=10.0)
        except httpx.HTTPError:
            return None
        return counter_total(response.text, IN_FLIGHT) if response.status_code == 200 else None

    async def redis_prefixes(self) -> dict[str, int]:
        """Key kind → count, over every key in Redis."""
        counts: dict[str, int] = {}
        async for key in self.redis.scan_iter(count=1000):
            kind = key_prefix(key.decode(errors="replace"), self.namespace)
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    async def drain_handoffs(self, drain_s: float, baseline: dict[str, int]) -> dict[str, Any]:
        """Wait (at most drain_s) until no hand-off record is left; then the keys per kind, the
        hand-offs still live and the expiry of those left, and what is not back to baseline."""
        start = time.monotonic()
        while True:
            end = await self.redis_prefixes()
            if not end.get(HANDOFF_PREFIX) or time.monotonic() - start >= drain_s:
                break
            await asyncio.sleep(2.0)
        live, ttls = await self._handoffs()
        return {
            "baseline": baseline,
            "end": end,
            "waited_s": time.monotonic() - start,
            "handoffs_left": len(ttls),
            "live_handoffs": live,
            "handoff_ttl_max_ms": max(ttls, default=None),
            "retention_ms": RETENTION_MS,
            "problems": redis_leftovers(baseline, end, live, ttls, RETENTION_MS),
        }

    async def _handoffs(self) -> tuple[int, list[int]]:
        """(live hand-off records, the PTTL of every one left)."""
        live, ttls = 0, []
        async for key in self.redis.scan_iter(match=f"{self.namespace}:{HANDOFF_PREFIX}:*"):
            state, ttl = await self.redis.hget(key, "state"), await self.redis.pttl(key)
            if ttl == -2:  # expired meanwhile
                continue
            ttls.append(int(ttl))
            name = state.decode() if state else ""
            live += name not in HandoffState.__members__ or not HandoffState[name].terminal
        return live, ttls


# ----- the table ----------------------------------------------------------------------------------


def print_report(r: dict[str, Any]) -> None:
    def num(value: float | None, spec: str = ".1f") -> str:
        return "n/a" if value is None else format(value, spec)

    print(
        f"bench soak: {r['sent']} requests in {r['duration_s']:.0f} s "
        f"({num(r['requests_per_s'], '.2f')}/s), warm-up {r['warmup_s']:.0f} s; {r['kinds']}"
    )
    for name in (*CATEGORIES, "lost"):
        print(f"  {name:<18} {r[name]}")
    for message, count in r["errors_by_message"].items():
        print(f"  {'':<18} {count} x {message}")
    print(f"  {'series':<26} {'base':>9} {'last':>9} {'growth':>8} {'fit':>9} {'limit':>8}  status")
    for f in r["flatness"]:
        pct = num(f["growth_pct"], "+.1f") + "%" if f["growth_pct"] is not None else "n/a"
        print(
            f"  {f['name']:<26} {num(f['base']):>9} {num(f['last']):>9} {pct:>8} "
            f"{num(f['fit_growth'], '+.1f'):>9} {num(f['limit']):>8}  {f['status']}"
        )
    leaked = r["leak_check"].get("leaked_blocks", {})
    print(f"  blocks held at idle: {', '.join(f'{k} {v}' for k, v in leaked.items()) or 'n/a'}")
    print(f"  in flight at the end: {r['in_flight_end']}; restarts: {r['restarts'] or 'none'}")
    end = r["redis_end"]
    print(f"  redis keys before load {end['baseline']}, at the end {end['end']}")
    print("  result: " + ("PASS" if not r["failures"] else "FAIL: " + "; ".join(r["failures"])))


# ----- the plot --------------------------------------------------------------------------------


def write_plot(path: str | Path, report: dict[str, Any]) -> Path:
    """RSS and fds per service, blocks per rank with the gateway's in-flight, Redis keys per kind;
    dotted lines at the end of warm-up and of the load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    ts = [s["t"] for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), sharex=True)
    panels = (
        (axes[0][0], "rss_mb", "RSS (MB)"),
        (axes[0][1], "fds", "open fds"),
        (axes[1][0], "blocks", "KV blocks held"),
        (axes[1][1], "redis_prefixes", "Redis keys"),
    )
    for ax, kind, title in panels:
        names = sorted({n for s in samples for n in s[kind]})
        for name in names:
            ax.plot(ts, [s[kind].get(name) for s in samples], label=name)
        if kind == "blocks":
            ax.plot(ts, [s["in_flight"] for s in samples], "k--", label="gateway in flight")
        if kind == "redis_prefixes":
            ax.plot(ts, [s["redis_keys"] for s in samples], "k-", label="total")
        for x in (report["warmup_s"], report["duration_s"]):
            ax.axvline(x, color="grey", linestyle=":")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="x-small", loc="upper left")
    for ax in axes[1]:
        ax.set_xlabel("seconds since the load began")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
