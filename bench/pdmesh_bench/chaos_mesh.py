"""The mesh side of `pdmesh bench chaos`: which process of a role may die now, SIGKILL on a
schedule, and the leak check over every worker rank's `Status` (sent with the mesh token)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.launcher import Mesh
from pdmesh_bench.chaos_core import Fault, PlannedFault, is_idle, killable, leak_report
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2_grpc
from pdmesh_proto.prefill.v1 import prefill_pb2_grpc
from pdmesh_service.grpc_server import MeshAuth, channel

WORKER_ROLES = ("prefill", "decode")


@dataclass
class MeshControl:
    """What the bench needs of a running `Mesh`: the processes of a role, which are alive and
    SERVING, SIGKILL, supervision, restart counts, and the mesh token for its own internal RPCs
    (`Status`)."""

    mesh: Mesh

    @property
    def auth(self) -> MeshAuth:
        return MeshAuth(self.mesh.mesh_token)

    def gave_up(self) -> str | None:
        """The service the supervisor gave up on (its restart budget ran out), if any."""
        return self.mesh.wait_gave_up(0) if self.mesh.supervisor is not None else None

    def names(self, role: str) -> list[str]:
        return self.mesh.names(role)

    def live_pid(self, name: str) -> int | None:
        return self.mesh.pid_of(name)

    async def serving(self, names: list[str]) -> list[str]:
        specs = {s.name: s for s in self.mesh.specs}
        return [n for n in names if n not in specs or await is_serving(specs[n].addresses)]

    async def kill_one(self, role: str, rng: random.Random, at_s: float) -> Fault:
        """SIGKILL one killable process of `role` (`chaos_core.killable`), drawn by rng."""
        names = self.names(role)
        live = [n for n in names if self.live_pid(n) is not None]
        serving = await self.serving(live)
        choices = killable(names, live, serving)
        name = rng.choice(choices) if choices else None
        pid = self.live_pid(name) if name is not None else None
        if name is None or pid is None:
            return Fault(at_s, role, None)
        os.kill(pid, signal.SIGKILL)
        return Fault(at_s, role, name, pid, name in serving)

    def worker_ranks(self) -> list[tuple[str, str, str]]:
        """(key, role, address) of every prefill and decode rank."""
        return [
            (f"{s.name}-r{r}" if s.rank_addresses else s.name, s.role, address)
            for s in self.mesh.specs
            if s.role in WORKER_ROLES
            for r, address in enumerate(s.addresses)
        ]


async def is_serving(addresses: tuple[str, ...]) -> bool:
    """Whether every rank answers SERVING to the health service (open: no token needed)."""
    for address in addresses:
        async with channel(address) as ch:
            try:
                reply = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=1.0
                )
            except grpc.RpcError:
                return False
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                return False
    return True


async def read_status(role: str, address: str, auth: MeshAuth) -> Any:
    """The rank's `WorkerStatus` with the KV integrity check run; None if it does not answer."""
    stub_class = decode_pb2_grpc.DecodeStub if role == "decode" else prefill_pb2_grpc.PrefillStub
    async with channel(address, auth) as ch:
        try:
            request = common_pb2.StatusRequest(check_integrity=True)
            return await stub_class(ch).Status(request, timeout=10.0)
        except grpc.RpcError:
            return None


async def leak_check(control: MeshControl, timeout_s: float) -> dict[str, Any]:
    """Wait until every rank is idle (at most timeout_s), then report its last status."""
    start = time.monotonic()
    while True:
        statuses = {
            key: await read_status(role, address, control.auth)
            for key, role, address in control.worker_ranks()
        }
        if all(is_idle(s) for s in statuses.values()) or time.monotonic() - start > timeout_s:
            return leak_report(statuses, time.monotonic() - start)
        await asyncio.sleep(0.5)


async def inject_faults(
    control: MeshControl,
    schedule: list[PlannedFault],
    now: Callable[[], float],
    rng: random.Random,
    faults: list[Fault],
    say: Callable[[str], None],
) -> None:
    """Each planned fault at its time on the `now` clock; appends what happened to `faults`."""
    for planned in schedule:
        await asyncio.sleep(max(0.0, planned.at_s - now()))
        fault = await control.kill_one(planned.role, rng, now())
        faults.append(fault)
        what = f"killed {fault.name} (pid {fault.pid})" if fault.name else "nothing to kill"
        say(f"{fault.at_s:6.1f} s  fault on {planned.role}: {what}")
