"""The EPLB controller as a service, for real: embedded Redis, its gRPC server on 127.0.0.1 (port
0), the test playing the DEP ranks through eplb_protocol."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from pdmesh_eplb import server as eplb_server
from pdmesh_eplb.planner import window_balancedness
from pdmesh_proto.eplb.v1 import eplb_pb2, eplb_pb2_grpc
from pdmesh_service import eplb_protocol as proto
from pdmesh_service.eplb_protocol import LoadReport
from pdmesh_service.redis_server import EmbeddedRedis
from pdmesh_service.registry import Registry, connect


def test_eplb_registers_serves_health_and_status_then_leaves_the_registry() -> None:
    deployment = f"eplb-{uuid.uuid4().hex[:8]}"

    async def main(redis_url: str) -> tuple[list, int, eplb_pb2.EplbStatus, list]:
        parser = argparse.ArgumentParser()
        eplb_server.add_arguments(parser)
        config = eplb_server.config_from_args(
            parser.parse_args(
                [
                    "--redis-url",
                    redis_url,
                    "--deployment",
                    deployment,
                    "--heartbeat-s",
                    "0.2",
                    "--no-rebalance",
                ]
            )
        )
        ready = asyncio.Event()
        task = asyncio.ensure_future(eplb_server.serve(config, ready))
        await asyncio.wait_for(ready.wait(), 20)
        redis = connect(redis_url)
        registry = Registry(redis, deployment)
        listed = await registry.instances("eplb")
        async with grpc.aio.insecure_channel(listed[0].address) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=eplb_server.SERVICE_NAME), timeout=5
            )
            status = await eplb_pb2_grpc.EplbStub(channel).Status(
                eplb_pb2.StatusRequest(), timeout=5
            )
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        after = await registry.instances("eplb")
        await redis.aclose()
        return listed, health.status, status, after

    with EmbeddedRedis() as redis:
        listed, health, status, after = asyncio.run(asyncio.wait_for(main(redis.url), 60))
    assert [i.role for i in listed] == ["eplb"]
    assert health == health_pb2.HealthCheckResponse.SERVING
    assert status.instance_id == listed[0].instance_id and status.enabled is False
    assert after == []


# ------------------------------------------------------------------------ the controller, balancing
# The test plays the DEP ranks: it writes LoadReports through eplb_protocol (the ranks' real
# contract) and "switches" them to a published version by reporting running_version = V under V's
# placement.

E, S, R = 16, 8, 8  # experts, redundant slots, ranks: P = 24 slots, 3 per rank
A = {"instance": "decode-a", "model": "target"}  # the (instance, model) most tests balance
FAST = [
    "--heartbeat-s",
    "0.2",
    "--poll-s",
    "0.05",
    "--eplb-window-steps",
    "100",
    "--eplb-step-interval",
    "300",
    "--eplb-move-budget",
    "0.5",
]


def _zipf(num_layers: int, num_experts: int, seed: int) -> np.ndarray:
    """[L, E] skewed loads, a different expert ranking per layer."""
    rng = np.random.default_rng(seed)
    base = 4000.0 / np.arange(1, num_experts + 1) ** 1.3
    return np.stack([rng.permutation(base) for _ in range(num_layers)])


def _identity(num_layers: int, num_experts: int) -> list[list[int]]:
    return [[s % num_experts for s in range(num_experts + S)] for _ in range(num_layers)]


async def _report(
    redis: Any,
    deployment: str,
    instance: str,
    model: str,
    loads: np.ndarray,
    p2l: list[list[int]],
    version: int = 0,
    step: int = 1000,
) -> None:
    """Every rank reports its share of `loads` routed through placement `p2l` (split over
    replicas)."""
    a = np.asarray(p2l)
    rows = np.arange(len(a))[:, None]
    replicas = np.zeros(loads.shape, dtype=np.int64)
    np.add.at(replicas, (rows, a), 1)
    per_rank = np.rint(loads[rows, a] / replicas[rows, a] / R).astype(np.int64)
    for rank in range(R):
        await proto.publish_load(
            redis,
            deployment,
            LoadReport(
                instance,
                model,
                rank,
                R,
                step=step,
                window_steps=100,
                running_version=version,
                staged_version=version,
                slot_counts=per_rank.tolist(),
                num_logical=loads.shape[1],
                switch_step=step - 500,
                expert_bytes=1 << 20,
            ),
        )


class _Controller:
    """One in-process controller: `start(args)`, its stub, `stop()` (a clean cancel)."""

    def __init__(self, redis_url: str, deployment: str) -> None:
        self.redis_url, self.deployment = redis_url, deployment
        self.task: asyncio.Task | None = None
        self.channel: grpc.aio.Channel | None = None

    async def start(self, *extra: str) -> eplb_pb2_grpc.EplbStub:
        parser = argparse.ArgumentParser()
        eplb_server.add_arguments(parser)
        config = eplb_server.config_from_args(
            parser.parse_args(
                ["--redis-url", self.redis_url, "--deployment", self.deployment, *FAST, *extra]
            )
        )
        ready = asyncio.Event()
        self.task = asyncio.ensure_future(eplb_server.serve(config, ready))
        await asyncio.wait_for(ready.wait(), 20)
        redis = connect(self.redis_url)
        (info,) = await Registry(redis, self.deployment).instances("eplb")
        await redis.aclose()
        self.channel = grpc.aio.insecure_channel(info.address)
        return eplb_pb2_grpc.EplbStub(self.channel)

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


async def _until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


def _scenario(body: Callable[[Any, str, _Controller], Awaitable[Any]]) -> Any:
    deployment = f"eplb-{uuid.uuid4().hex[:8]}"

    async def main(redis_url: str) -> Any:
        redis, controller = connect(redis_url), _Controller(redis_url, deployment)
        try:
            return await body(redis, deployment, controller)
        finally:
            await controller.stop()
            await redis.aclose()

    with EmbeddedRedis() as server:
        return asyncio.run(asyncio.wait_for(main(server.url), 90))


async def _is(
    redis: Any, deployment: str, instance: str, version: int, model: str = "target"
) -> bool:
    """Whether (instance, model)'s published version is `version` (0: none written)."""
    found = await proto.read_placement(redis, deployment, instance, model)
    return (0 if found is None else found.version) == version


def _balancedness(loads: np.ndarray, p2l: list[list[int]]) -> float:
    return window_balancedness(loads, np.asarray(p2l), R)


def test_a_skewed_instance_gets_version_1_and_a_balanced_one_nothing() -> None:
    skewed = _zipf(2, E, seed=1)
    # identity puts 100 on every slot
    even = np.tile(np.where(np.arange(E) < S, 200.0, 100.0), (2, 1))

    async def body(redis: Any, deployment: str, controller: _Controller) -> None:
        await _report(redis, deployment, "decode-a", "target", skewed, _identity(2, E))
        await _report(redis, deployment, "decode-b", "target", even, _identity(2, E))
        # unreadable
        await redis.set(proto.load_key(deployment, "decode-z", "target", 0), b'{"rank": 0}')
        stub = await controller.start()
        await _until(lambda: _is(redis, deployment, "decode-a", 1))
        await asyncio.sleep(0.5)  # ten more polls
        placement = await proto.read_placement(redis, deployment, "decode-a", "target")
        assert placement is not None and placement.version == 1  # ranks still on 0: no version 2
        assert await proto.read_placement(redis, deployment, "decode-b", "target") is None
        assert (
            _balancedness(skewed, placement.physical_to_logical)
            > _balancedness(skewed, _identity(2, E)) + 0.1
        )
        (record,) = await proto.read_history(redis, deployment, "decode-a", "target")
        assert record.reason == "interval" and record.num_slots_moved > 0
        assert record.num_bytes_moved == record.num_slots_moved << 20
        assert record.balancedness_after > record.balancedness_before + 0.01
        status = await stub.Status(eplb_pb2.StatusRequest(), timeout=5)
        by_instance = {m.instance: m for m in status.models}
        a = by_instance["decode-a"]
        assert a.placement_version == 1 and [r.running_version for r in a.ranks] == [0] * R
        assert a.last_rebalance.version == 1 and a.num_slots == E + S and a.num_ranks == R
        assert a.has_balancedness is False  # no rank on version 1 yet
        assert by_instance["decode-z"].placement_version == 0 and not by_instance["decode-z"].ranks
        b = by_instance["decode-b"]
        assert (
            b.placement_version == 0 and b.has_balancedness and b.balancedness == pytest.approx(1.0)
        )
        assert not b.HasField("last_rebalance")
        assert (
            REGISTRY.get_sample_value(
                "pdmesh_eplb_placement_version", {"instance": "decode-a", "model": "target"}
            )
            == 1
        )
        assert (
            REGISTRY.get_sample_value("pdmesh_eplb_rebalances_total", {"reason": "interval"}) >= 1
        )

    _scenario(body)


def test_manual_rebalance_get_placement_and_the_off_switch() -> None:
    skewed = _zipf(2, E, seed=2)

    async def body(redis: Any, deployment: str, controller: _Controller) -> None:
        stub = await controller.start("--no-rebalance")
        await _report(redis, deployment, "decode-a", "target", skewed, _identity(2, E))
        await asyncio.sleep(0.5)
        assert await _is(redis, deployment, "decode-a", 0)  # off by default: nothing
        current = await stub.GetPlacement(eplb_pb2.GetPlacementRequest(**A), timeout=10)
        assert current.version == 0 and [list(x.logical) for x in current.layers] == _identity(2, E)

        unknown = await stub.Rebalance(
            eplb_pb2.RebalanceRequest(instance="prefill-z", model="target"), timeout=10
        )
        assert not unknown.rebalanced and "no load reports" in unknown.reason
        manual = await stub.Rebalance(eplb_pb2.RebalanceRequest(**A), timeout=10)
        assert manual.rebalanced and manual.record.version == 1 and manual.record.reason == "manual"
        again = await stub.Rebalance(eplb_pb2.RebalanceRequest(**A), timeout=10)
        assert (
            not again.rebalanced and "waiting for the ranks to switch to version 1" in again.reason
        )

        got = await stub.GetPlacement(eplb_pb2.GetPlacementRequest(**A), timeout=10)
        stored = await proto.read_placement(redis, deployment, "decode-a", "target")
        assert (
            got.version == 1 and [list(x.logical) for x in got.layers] == stored.physical_to_logical
        )
        assert [h.version for h in got.history] == [1]
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.GetPlacement(eplb_pb2.GetPlacementRequest(**A, version=9), timeout=10)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND

        # the ranks switch to 1 under a new skew: turning the instance on lets the loop publish 2
        await _report(
            redis,
            deployment,
            "decode-a",
            "target",
            _zipf(2, E, seed=3),
            stored.physical_to_logical,
            version=1,
        )
        await asyncio.sleep(0.5)
        assert await _is(redis, deployment, "decode-a", 1)
        on = await stub.SetEnabled(
            eplb_pb2.SetEnabledRequest(instance="decode-a", enabled=True), timeout=10
        )
        assert on.enabled
        await _until(lambda: _is(redis, deployment, "decode-a", 2))
        off = await stub.SetEnabled(
            eplb_pb2.SetEnabledRequest(instance="decode-a", enabled=False), timeout=10
        )
        assert not off.enabled and not await proto.is_enabled(redis, deployment, "decode-a")
        v2 = await proto.read_placement(redis, deployment, "decode-a", "target")
        await _report(
            redis,
            deployment,
            "decode-a",
            "target",
            _zipf(2, E, seed=4),
            v2.physical_to_logical,
            version=2,
        )
        await asyncio.sleep(0.5)
        assert await _is(redis, deployment, "decode-a", 2)  # off again: stays on 2

    _scenario(body)


def test_a_restarted_controller_keeps_versions_and_history_and_continues() -> None:
    async def body(redis: Any, deployment: str, controller: _Controller) -> None:
        await _report(redis, deployment, "decode-a", "target", _zipf(2, E, seed=5), _identity(2, E))
        await controller.start()
        await _until(lambda: _is(redis, deployment, "decode-a", 1))
        await controller.stop()
        v1 = await proto.read_placement(redis, deployment, "decode-a", "target")
        await _report(
            redis,
            deployment,
            "decode-a",
            "target",
            _zipf(2, E, seed=6),
            v1.physical_to_logical,
            version=1,
        )
        stub = await controller.start()
        await _until(lambda: _is(redis, deployment, "decode-a", 2))
        got = await stub.GetPlacement(eplb_pb2.GetPlacementRequest(**A, version=1), timeout=10)
        assert [list(x.logical) for x in got.layers] == v1.physical_to_logical
        assert [h.version for h in got.history] == [2, 1]

    _scenario(body)


def test_prefill_and_decode_instances_and_two_model_shapes_are_balanced_separately() -> None:
    loads = {
        ("prefill-a", "target"): _zipf(3, E, seed=7),
        ("decode-a", "target"): _zipf(3, E, seed=8),
        ("decode-a", "draft"): _zipf(1, 8, seed=9),
    }

    async def body(redis: Any, deployment: str, controller: _Controller) -> None:
        for (instance, model), w in loads.items():
            await _report(redis, deployment, instance, model, w, _identity(*w.shape))
        await controller.start()
        for key in loads:
            await _until(lambda key=key: _is(redis, deployment, key[0], 1, key[1]))
        placed = {
            k: (await proto.read_placement(redis, deployment, *k)).physical_to_logical
            for k in loads
        }
        assert np.asarray(placed["decode-a", "draft"]).shape == (1, 8 + S)
        assert np.asarray(placed["decode-a", "target"]).shape == (3, E + S)
        prefill, decode = placed["prefill-a", "target"], placed["decode-a", "target"]
        assert prefill != decode
        # each fitted to its own loads: better on them than the other instance's placement
        on_prefill, on_decode = loads["prefill-a", "target"], loads["decode-a", "target"]
        assert _balancedness(on_prefill, prefill) > _balancedness(on_prefill, decode)
        assert _balancedness(on_decode, decode) > _balancedness(on_decode, prefill)

    _scenario(body)


def test_killing_the_controller_mid_rebalance_leaves_one_consistent_version_chain() -> None:
    """SIGKILL the controller process at random moments while it rebalances without pause (the ranks
    switch to every version at once, under drifting loads): every version it published is whole,
    with its history record, and versions form one chain ..., V-1, V with no gap or fork; each new
    controller continues it."""
    deployment = f"eplb-{uuid.uuid4().hex[:8]}"
    rng = np.random.default_rng(0)

    def spawn(redis_url: str) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdmesh_eplb",
                "--redis-url",
                redis_url,
                "--deployment",
                deployment,
                *FAST,
                "--poll-s",
                "0.01",
                "--eplb-min-gain",
                "0",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    async def follow(redis: Any, seen: list[int], until_s: float) -> None:
        """The ranks: switch to each published version at once and report new (drifting) loads under
        it."""
        deadline = asyncio.get_running_loop().time() + until_s
        while asyncio.get_running_loop().time() < deadline:
            current = await proto.read_placement(redis, deployment, "decode-a", "target")
            version, p2l = (
                (0, _identity(2, E))
                if current is None
                else (current.version, current.physical_to_logical)
            )
            if version and (not seen or seen[-1] != version):
                seen.append(version)
            await _report(
                redis,
                deployment,
                "decode-a",
                "target",
                _zipf(2, E, seed=int(rng.integers(1 << 30))),
                p2l,
                version=version,
            )
            await asyncio.sleep(0.01)

    async def main(redis_url: str) -> tuple[list[int], Any, list[Any], list[Any]]:
        redis, seen = connect(redis_url), []
        try:
            for _ in range(4):
                process = spawn(redis_url)
                await follow(redis, seen, until_s=float(rng.uniform(2.0, 3.5)))
                process.kill()
                process.wait(10)
            current = await proto.read_placement(redis, deployment, "decode-a", "target")
            history = await proto.read_history(redis, deployment, "decode-a", "target")
            kept = range(max(current.version - proto.HISTORY_LIMIT, 0) + 1, current.version + 1)
            versions = [
                await proto.read_placement(redis, deployment, "decode-a", "target", version=v)
                for v in kept
            ]
            return seen, current, history, versions
        finally:
            await redis.aclose()

    with EmbeddedRedis() as server:
        seen, current, history, versions = asyncio.run(asyncio.wait_for(main(server.url), 120))
    assert current.version >= 4, "the controller published too few versions to test anything"
    assert seen == sorted(set(seen)) and seen[-1] in (current.version - 1, current.version)
    kept = list(range(current.version, max(current.version - proto.HISTORY_LIMIT, 0), -1))
    assert [r.version for r in history] == kept  # the newest 100, no gap, no fork
    assert [p.version for p in versions] == kept[::-1] and versions[-1] == current
    for placement in versions:  # each one whole: every expert in every layer
        assert all(set(row) == set(range(E)) for row in placement.physical_to_logical)
