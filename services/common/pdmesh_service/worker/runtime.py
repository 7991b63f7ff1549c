"""Wiring shared by the decode and prefill servers: engine, NIXL agent, kvstore, gRPC, heartbeat.

`run_worker` builds the engine and a NIXL agent (named after the instance id) over its KV pool,
publishes the agent's metadata in the kvstore, starts the engine thread and the gRPC server, then
heartbeats `InstanceInfo(ready=True, stats=...)` until cancelled; on the way out it deregisters,
stops serving, aborts everything in the engine and closes its clients (in that order).

A DEP rank (`DEPOptions.is_rank`; its `common` comes from `dep_instance.rank_common`) first joins its
instance's group, builds the engine with its share of the experts, registers as `<id>-r<rank>` with rank
and dp_size, and also ends (raising `ServiceStopped`) when its engine loop ends on its own: another rank
stopped or the group broke.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from pdmesh_engine.config import EngineConfig
from pdmesh_engine.engine_core import EngineCore
from pdmesh_engine.parallel.dep import DEPConfig, DEPContext, init_dep, shutdown_dep
from pdmesh_service.grpc_server import start_grpc_server
from pdmesh_service.logging import get_logger
from pdmesh_service.options import CommonConfig, ServiceStopped
from pdmesh_service.redis_server import free_port
from pdmesh_service.registry import InstanceInfo, Registry, connect, stay_registered
from pdmesh_service.kvstore_client import KVStoreClient
from pdmesh_service.worker.convert import heartbeat_stats
from pdmesh_service.worker.dep_instance import DEPOptions, master_addr
from pdmesh_service.worker.engine_loop import EngineLoop
from pdmesh_engine.transfer.agent import KVTransferAgent

log = get_logger(__name__)
KVSTORE_DISCOVERY_S = 30.0


@dataclass(frozen=True)
class WorkerParts:
    """What a servicer is built from."""

    instance_id: str
    engine: EngineLoop
    agent: KVTransferAgent
    kvstore: KVStoreClient


@dataclass(frozen=True)
class WorkerSpec:
    role: str                                          # "decode" | "prefill"
    service_name: str                                  # full gRPC service name, for health
    make_servicer: Callable[[WorkerParts], Any]
    add_servicer: Callable[[Any, grpc.aio.Server], None]


async def discover_kvstore(registry: Registry, timeout_s: float = KVSTORE_DISCOVERY_S) -> str:
    """The address of a ready kvstore instance in the registry (waits for one to appear)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        found = [i for i in await registry.instances("kvstore") if i.ready]
        if found:
            return found[0].address
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"no kvstore instance registered within {timeout_s:g}s (pass --kvstore)")
        await asyncio.sleep(0.5)


async def run_worker(spec: WorkerSpec, common: CommonConfig, model_dir: Path, engine_config: EngineConfig,
                     kvstore_address: str = "", ready: asyncio.Event | None = None,
                     dep: DEPOptions | None = None) -> None:
    """Serve until cancelled (see the module docstring)."""
    dep = dep if dep is not None and dep.size > 1 else None
    if dep is not None and not dep.is_rank:
        raise ValueError("a DEP instance is started with `pdmesh serve ROLE --dep N`, which runs its ranks")
    port = common.port or (0 if common.instance_id else free_port(common.host))   # the default id needs it
    instance_id = common.instance(spec.role, port)
    context = await asyncio.to_thread(_join_dep, common, dep) if dep is not None else None
    engine = await asyncio.to_thread(EngineCore, model_dir, engine_config, context)
    # Decode needs NIXL's progress thread to receive writes promptly; prefill drives progress itself
    # (poll/wait on its own transfers), which measured faster than with the thread.
    agent = KVTransferAgent(instance_id, engine.runner.kv_caches, progress_thread=spec.role == "decode")
    rank, size = (dep.rank, dep.size) if dep is not None else (0, 1)
    loop = EngineLoop(engine, agent, instance_id, rank, size)
    redis = connect(common.redis_url)
    registry = Registry(redis, common.deployment)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(redis.aclose)
        stack.callback(agent.close)                   # after the engine thread, its only user, ended
        if context is not None:
            stack.callback(shutdown_dep)              # likewise: the thread's last step was a collective
        kvstore = KVStoreClient(kvstore_address or await discover_kvstore(registry))
        stack.push_async_callback(kvstore.close)
        await kvstore.register_agent(instance_id, agent.metadata(), instance_id)
        servicer = spec.make_servicer(WorkerParts(instance_id, loop, agent, kvstore))   # sets loop.role
        loop.start()
        stack.push_async_callback(loop.stop)
        if hasattr(servicer, "close"):
            stack.push_async_callback(servicer.close)
        server = await start_grpc_server(common.host, port, [lambda s: spec.add_servicer(servicer, s)],
                                         [spec.service_name])
        stack.push_async_callback(server.stop)
        info = InstanceInfo(instance_id, spec.role, common.address(server.port), rank=rank, dp_size=size,
                            model=Path(model_dir).resolve().name, ready=True)
        await stay_registered(stack, registry, lambda: _report(loop, info), common.heartbeat_s)
        await server.set_serving(True)
        log.info("serving", role=spec.role, instance=instance_id, address=info.address, rank=rank, dp_size=size,
                 kv_blocks=engine.runner.kv_layout.num_blocks)
        if ready is not None:
            ready.set()
        await _until_stopped(loop, instance_id, context is not None)


def _join_dep(common: CommonConfig, dep: DEPOptions) -> DEPContext:
    """Join the instance's group (blocks until every rank joined)."""
    return init_dep(DEPConfig(dep.rank, dep.size, master_addr(common.host), dep.dist_port, dp_sync=dep.dp_sync,
                              num_redundant_experts=dep.num_redundant_experts))


async def _until_stopped(loop: EngineLoop, instance_id: str, dep: bool) -> None:
    """Until cancelled; a DEP rank also ends when its engine loop does (the instance cannot go on)."""
    if not dep:
        await asyncio.Future()
    reason = await asyncio.shield(loop.ended)
    raise ServiceStopped(f"{instance_id}: {reason}")


async def _report(loop: EngineLoop, info: InstanceInfo) -> InstanceInfo:
    status = await loop.status()
    return replace(info, stats=heartbeat_stats(status))
