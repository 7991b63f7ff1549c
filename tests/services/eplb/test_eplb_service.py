"""The EPLB controller as a service, for real: embedded Redis, its gRPC server on 127.0.0.1 (port 0)."""
from __future__ import annotations

import argparse
import asyncio
import uuid

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh_eplb import server as eplb_server
from pdmesh_proto.eplb.v1 import eplb_pb2, eplb_pb2_grpc
from pdmesh_service.redis_server import EmbeddedRedis
from pdmesh_service.registry import Registry, connect


def test_eplb_registers_serves_health_and_status_then_leaves_the_registry() -> None:
    deployment = f"eplb-{uuid.uuid4().hex[:8]}"

    async def main(redis_url: str) -> tuple[list, int, eplb_pb2.EplbStatus, list]:
        parser = argparse.ArgumentParser()
        eplb_server.add_arguments(parser)
        config = eplb_server.config_from_args(parser.parse_args(
            ["--redis-url", redis_url, "--deployment", deployment, "--heartbeat-s", "0.2", "--no-rebalance"]))
        ready = asyncio.Event()
        task = asyncio.ensure_future(eplb_server.serve(config, ready))
        await asyncio.wait_for(ready.wait(), 20)
        redis = connect(redis_url)
        registry = Registry(redis, deployment)
        listed = await registry.instances("eplb")
        async with grpc.aio.insecure_channel(listed[0].address) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=eplb_server.SERVICE_NAME), timeout=5)
            status = await eplb_pb2_grpc.EplbStub(channel).Status(eplb_pb2.StatusRequest(), timeout=5)
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
