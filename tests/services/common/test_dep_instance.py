"""DEP instances of the workers without processes: options, per-rank settings, the launcher's plan,
and the engine loop's lockstep driving (a fake engine: one collective per iteration, idle back-off,
shared stop)."""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
from pathlib import Path

import pytest

from pdmesh.launcher import MeshOptions, plan_mesh
from pdmesh_engine.parallel.dep import LockstepRecord
from pdmesh_service.options import CommonConfig
from pdmesh_service.redis_server import free_port_block
from pdmesh_service.worker import engine_loop
from pdmesh_service.worker.dep_instance import DEPOptions, master_addr, rank_argv, rank_common
from pdmesh_service.worker.engine_loop import EngineLoop


def test_dep_options_validate() -> None:
    assert DEPOptions(2).is_supervisor and not DEPOptions(2).is_rank
    assert DEPOptions(2, 1, 29500).is_rank and not DEPOptions(1).is_supervisor
    for bad, message in [
        (dict(size=0), "--dep"),
        (dict(size=2, rank=2, dist_port=1), "--dep-rank"),
        (dict(size=2, rank=0), "--dist-port"),
        (dict(size=2, dp_sync="ring"), "--dp-sync"),
        (dict(size=1, num_redundant_experts=2), "needs --dep > 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            DEPOptions(**bad)


def test_rank_common_gives_each_rank_its_port_id_and_metrics() -> None:
    common = CommonConfig(port=7000, metrics_port=9000)
    assert rank_common(common, "decode", DEPOptions(4)) == common  # the supervisor: as given
    rank = rank_common(common, "decode", DEPOptions(4, 3, 29500))
    assert (rank.port, rank.instance_id, rank.metrics_port) == (7003, "decode-7000-r3", 9003)
    named = rank_common(
        CommonConfig(port=7000, instance_id="decode-0"), "decode", DEPOptions(2, 1, 29500)
    )
    assert (named.instance_id, named.metrics_port) == ("decode-0-r1", None)
    by_hand = rank_common(CommonConfig(), "prefill", DEPOptions(2, 1, 29500))
    assert (by_hand.port, by_hand.instance_id) == (0, "")  # any free port, ROLE-PORT
    assert master_addr("0.0.0.0") == "127.0.0.1" and master_addr("10.0.0.5") == "10.0.0.5"


def test_rank_argv_pins_the_rank_after_the_options() -> None:
    argv = rank_argv("decode", ["--dep", "2", "--port", "0"], 1, 7000, 29500)
    module = argv.index("-m") + 1
    assert argv[module:] == [
        "pdmesh_decode",
        "--dep",
        "2",
        "--port",
        "0",
        "--port",
        "7000",
        "--dist-port",
        "29500",
        "--dep-rank",
        "1",
    ]


def test_plan_mesh_gives_dep_instances_a_port_block() -> None:
    ports, blocks = iter(range(6000, 6100)), iter(range(7000, 8000, 10))
    options = MeshOptions(
        Path("m"), num_prefill=1, num_decode=2, prefill_dep=1, decode_dep=4, num_redundant_experts=4
    )
    specs = plan_mesh(
        options,
        port_of=lambda host: next(ports),
        block_of=lambda host, n: next(blocks),
    )
    prefill, decode = (
        [s for s in specs if s.role == "prefill"],
        [s for s in specs if s.role == "decode"],
    )
    assert prefill[0].addresses == (prefill[0].grpc_address,) and "--dep" not in prefill[0].argv
    assert decode[0].addresses == tuple(f"127.0.0.1:{7000 + r}" for r in range(4))
    argv = decode[1].argv
    assert (
        argv[argv.index("--dep") + 1] == "4"
        and argv[argv.index("--num-redundant-experts") + 1] == "4"
    )
    assert options.num_worker_processes == 9
    with pytest.raises(ValueError, match="needs --prefill-dep or --decode-dep"):
        MeshOptions(Path("m"), num_redundant_experts=2)


def test_free_port_block_is_consecutive_and_free() -> None:
    base = free_port_block("127.0.0.1", 3)
    for port in range(base, base + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


# ----- the engine loop's lockstep driving -----
class _FakeLockstep:
    def __init__(self) -> None:
        self.last: LockstepRecord | None = None
        self.stop_requested = False
        self.peer_stops = False

    def request_stop(self) -> None:
        self.stop_requested = True


class _FakeEngine:
    """Every step() stands for one collective; nobody ever has work."""

    has_unfinished = False

    def __init__(self) -> None:
        self.lockstep = _FakeLockstep()
        self.steps = 0

    def request_ids(self) -> list[str]:
        return []

    def step(self) -> list:
        self.steps += 1
        stop = self.lockstep.stop_requested or self.lockstep.peer_stops
        self.lockstep.last = LockstepRecord(0, 0, 0, 0, False, False, stop)
        return []


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_idle_lockstep_backs_off_and_stops_every_rank_together() -> None:
    async def scenario() -> tuple[int, int, str, bool]:
        engine = _FakeEngine()
        loop = EngineLoop(engine, instance_id="fake-r0")
        loop.start()
        await asyncio.sleep(0.5)
        idle_steps = engine.steps
        assert await loop.submit(lambda: 42) == 42  # commands still run between syncs
        await loop.stop()
        return idle_steps, engine.steps, await loop.ended, engine.lockstep.last.stop

    idle_steps, steps, reason, last_stop = _run(scenario())
    cap = 0.5 / engine_loop.IDLE_SYNC_MAX_S
    assert 5 <= idle_steps <= cap + 15, idle_steps  # keeps syncing, but not in a busy spin
    assert reason == "stopped" and last_stop and steps > idle_steps


def test_another_ranks_stop_ends_the_loop() -> None:
    async def scenario() -> str:
        engine = _FakeEngine()
        loop = EngineLoop(engine, instance_id="fake-r1")
        loop.start()
        await asyncio.sleep(0.05)
        started = time.monotonic()
        engine.lockstep.peer_stops = True
        reason = await loop.ended
        assert time.monotonic() - started < 1.0
        await loop.stop()
        return reason

    assert _run(scenario()) == "another rank of this DEP instance stopped"


def test_launcher_passes_gateway_admission_only_when_set() -> None:
    def gateway_argv(**kw) -> tuple[str, ...]:
        specs = plan_mesh(MeshOptions(model_dir=Path("/m"), **kw))
        return next(s.argv for s in specs if s.role == "gateway")

    argv = gateway_argv(max_prefill_inflight=3)
    assert argv[argv.index("--max-prefill-inflight") + 1] == "3"
    assert "--max-prefill-inflight" not in gateway_argv()


def test_plan_mesh_starts_the_eplb_controller_after_the_kvstore() -> None:
    specs = plan_mesh(MeshOptions(model_dir=Path("/m")))
    roles = [s.role for s in specs]
    assert (
        roles.index("kvstore")
        < roles.index("eplb")
        < roles.index("prefill")
        < roles.index("gateway")
    )
    eplb = next(s for s in specs if s.role == "eplb")
    assert eplb.argv[eplb.argv.index("serve") + 1] == "eplb" and "--model" not in eplb.argv


def test_dist_host_ranks_one_per_host_keep_their_ports_and_meet_at_rank_zero() -> None:
    dep = DEPOptions(4, 2, 29500, dist_host="decode-0.decode-ranks")
    rank = rank_common(
        CommonConfig(host="0.0.0.0", port=50051, instance_id="decode-0", metrics_port=9090),
        "decode",
        dep,
    )
    assert (rank.port, rank.metrics_port, rank.instance_id) == (50051, 9090, "decode-0-r2")
    assert master_addr("0.0.0.0", dep.dist_host) == "decode-0.decode-ranks"
    with pytest.raises(ValueError, match="--dist-host"):
        DEPOptions(4, None, 29500, dist_host="decode-0")


def test_pdmesh_up_passes_the_eplb_options_to_the_controller_only() -> None:
    from pdmesh.cli.up_cmd import eplb_argv

    args = argparse.Namespace(no_eplb=True, eplb_window_steps=8, eplb_step_interval=None)
    options = MeshOptions(model_dir=Path("/m"), eplb_args=eplb_argv(args))
    specs = plan_mesh(options)
    eplb = next(s for s in specs if s.role == "eplb")
    assert eplb.argv[-3:] == ("--no-rebalance", "--eplb-window-steps", "8")
    assert all("--eplb-window-steps" not in s.argv for s in specs if s.role != "eplb")


def test_plan_mesh_never_hands_out_one_port_twice() -> None:
    picks = iter([6000, 6000, 6001, 8000, 6002, 6003, 6003, 6004, 6005, 6006, 6007, 6008, 6009])
    options = MeshOptions(Path("m"), grpc_port=8000, http_port=8001)
    specs = plan_mesh(options, port_of=lambda host: next(picks))
    ports = [int(s.grpc_address.rsplit(":", 1)[1]) for s in specs] + [
        s.metrics_port for s in specs if s.metrics_port is not None
    ]
    assert len(ports) == len(set(ports)) and 6000 in ports and ports.count(8000) == 1
