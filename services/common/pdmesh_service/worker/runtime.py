"""Wiring shared by the decode and prefill servers: engine, NIXL agent, kvstore, gRPC, heartbeat.

`run_worker` builds the engine, a NIXL agent (named after the instance id) over its KV pool (and the
speculative proposer's pool beside it, when speculation is on) and the rank's `WorkerMetrics`,
publishes the agent's metadata in the kvstore, builds the role's `Worker` from those parts
(`WorkerSpec.make_worker`: the role that runs in the engine thread and the servicer over it), starts
the engine thread with that role and the gRPC server, then heartbeats `InstanceInfo(ready=True,
stats=...)` with the rank's revision (`engine_revision`: what must match across a hand-off) and,
from SIGTERM on with --drain-s, `draining=True` (and sets the load gauges) and, with prefix
caching on, publishes the pool's KV events to the kvstore's prefix index (`worker.kv_events`, rank
id = the instance id) until cancelled; on the way out it stops publishing, deregisters, stops
serving, closes the role, aborts everything in the engine and closes its clients (in that order).

A DEP rank (`DEPOptions.is_rank`; its `common` comes from `dep_instance.rank_common`) first joins
its instance's group, builds the engine with its share of the experts, registers as `<id>-r<rank>`
with rank and dp_size, runs its EPLB agent (`worker.eplb_agent`, every --eplb-report-s; 0: none),
and also ends (raising `ServiceStopped`) when its engine loop ends on its own: another rank stopped
or the group broke. An elastic instance's rank (`--dep-elastic`) outlives a lost peer: its group
re-forms (records in Redis, `worker.elastic_store`); a restarted one (`--dep-rejoin`) builds its
engine, then is admitted into the running group just before its engine thread starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import grpc
from redis.exceptions import RedisError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from pdmesh_engine.config import EngineConfig
from pdmesh_engine.engine_core import EngineCore
from pdmesh_engine.model.configs import check_mesh_model
from pdmesh_engine.parallel.dep import DEPConfig, DEPContext, init_dep, shutdown_dep
from pdmesh_engine.parallel.elastic import (
    ELASTIC_DP_SYNC,
    ElasticConfig,
    ElasticGroup,
    join_elastic,
)
from pdmesh_engine.transfer.agent import KVTransferAgent
from pdmesh_engine.transfer.layout import KV_FORMAT_VERSION
from pdmesh_service.errors import MeshError
from pdmesh_service.grpc_server import MeshAuth, start_grpc_server
from pdmesh_service.instance import Role
from pdmesh_service.kvstore_client import KVStoreClient
from pdmesh_service.logging import get_logger
from pdmesh_service.options import CommonConfig, ServiceStopped
from pdmesh_service.probes import Probes
from pdmesh_service.redis_server import free_port
from pdmesh_service.registry import InstanceInfo, Registry, connect, stay_registered
from pdmesh_service.revision import Revision, checkpoint_identity, revision_parts
from pdmesh_service.tasks import pause, stop_with
from pdmesh_service.worker.convert import heartbeat_stats
from pdmesh_service.worker.dep_instance import DEPOptions, master_addr
from pdmesh_service.worker.elastic_store import membership_store
from pdmesh_service.worker.engine_loop import EngineLoop, EngineRole
from pdmesh_service.worker.eplb_agent import EPLBAgentConfig, base_instance, run_eplb_agent
from pdmesh_service.worker.kv_events import start_kv_event_publisher
from pdmesh_service.worker.metrics import WorkerMetrics

if TYPE_CHECKING:
    import redis.asyncio as aioredis

log = get_logger(__name__)
KVSTORE_DISCOVERY_S = 30.0
PEER_WAIT_S = 60.0  # how long a starting worker waits for its kvstore to answer
ServicerT = TypeVar("ServicerT")


class WorkerRole(EngineRole, Protocol):
    """What `run_worker` needs from a rank's role: the engine-thread hooks, and `close()` for its
    event-loop work (called after the gRPC server stopped, before the engine loop stops)."""

    async def close(self) -> None: ...


@dataclass(frozen=True)
class WorkerParts:
    """What a role's `Worker` is built from."""

    instance_id: str
    engine: EngineLoop  # not started yet: `run_worker` starts it with the role built from these
    agent: KVTransferAgent
    kvstore: KVStoreClient
    revision: Revision = Revision()  # what a hand-off peer must match (`engine_revision`)


@dataclass(frozen=True)
class Worker(Generic[ServicerT]):
    """A rank's role (runs in the engine thread) and the gRPC servicer over it."""

    role: WorkerRole
    servicer: ServicerT


@dataclass(frozen=True)
class WorkerSpec:
    role: str  # "decode" | "prefill"
    service_name: str  # full gRPC service name, for health
    make_worker: Callable[[WorkerParts], Worker[Any]]
    add_servicer: Callable[[Any, grpc.aio.Server], None]


async def _until_done(
    call: Callable[[], Awaitable[object]], what: str, timeout_s: float = PEER_WAIT_S
) -> None:
    """`call()` until it works, waiting out a peer that is down (a kvstore or Redis restarting: a
    worker started meanwhile waits for it rather than dying), with backoff; the last error after
    `timeout_s`."""
    retrying = AsyncRetrying(
        retry=retry_if_exception_type((MeshError, RedisError, OSError)),
        wait=wait_exponential(multiplier=0.2, max=2.0),
        stop=stop_after_delay(timeout_s),
        before_sleep=lambda state: log.warning(
            f"{what} failed; retrying",
            error=str(state.outcome.exception() if state.outcome else ""),
        ),
        reraise=True,
    )

    async def attempt() -> None:  # tenacity awaits only coroutine functions
        await call()

    await retrying(attempt)


async def discover_kvstore(registry: Registry, timeout_s: float = KVSTORE_DISCOVERY_S) -> str:
    """The address of a ready kvstore instance in the registry (waits for one to appear, and for
    Redis)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            found = [i for i in await registry.instances(Role.KVSTORE) if i.ready]
        except (RedisError, OSError) as e:
            if asyncio.get_running_loop().time() > deadline:
                raise
            log.warning("registry unreachable while looking for the kvstore", error=str(e))
            found = []
        if found:
            return found[0].address
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(
                f"no kvstore instance registered within {timeout_s:g}s (pass --kvstore)"
            )
        await pause(0.5)


async def run_worker(
    spec: WorkerSpec,
    common: CommonConfig,
    model_dir: Path,
    engine_config: EngineConfig,
    kvstore_address: str = "",
    ready: asyncio.Event | None = None,
    dep: DEPOptions | None = None,
) -> None:
    """Serve until cancelled (see the module docstring)."""
    check_mesh_model(model_dir)
    dep = dep if dep is not None and dep.size > 1 else None
    if dep is not None and not dep.is_rank:
        raise ValueError(
            "a DEP instance is started with `pdmesh serve ROLE --dep N`, which runs its ranks"
        )
    # the default id needs it
    port = common.port or (0 if common.instance_id else free_port(common.host))
    instance_id = common.instance(spec.role, port)
    context, finish_join = (
        await asyncio.to_thread(_join_dep, common, dep, instance_id)
        if dep is not None
        else (None, None)
    )
    engine = await asyncio.to_thread(EngineCore, model_dir, engine_config, context)
    # Decode needs NIXL's progress thread to receive writes promptly; prefill drives progress itself
    # (poll/wait on its own transfers), which measured faster than with the thread.
    # every KV group is registered (the proposer's pool too, with speculative decoding)
    agent = KVTransferAgent(instance_id, engine.kv_memory(), progress_thread=spec.role == "decode")
    rank, size = (dep.rank or 0, dep.size) if dep is not None else (0, 1)  # a DEP rank has its rank
    loop = EngineLoop(engine, agent, instance_id, rank, size, WorkerMetrics(instance_id))
    redis = connect(common.redis_url)
    registry = Registry(redis, common.deployment)
    auth = MeshAuth.from_config(common)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(redis.aclose)
        stack.callback(agent.close)  # after the engine thread, its only user, ended
        if context is not None:
            stack.callback(shutdown_dep)  # likewise: the thread's last step was a collective
        kvstore = KVStoreClient(kvstore_address or await discover_kvstore(registry), auth=auth)
        stack.push_async_callback(kvstore.close)
        await _until_done(
            lambda: kvstore.register_agent(instance_id, agent.metadata(), instance_id),
            "registering the NIXL agent in the kvstore",
        )
        revision = await asyncio.to_thread(engine_revision, engine, model_dir, agent)
        worker = spec.make_worker(WorkerParts(instance_id, loop, agent, kvstore, revision))
        if finish_join is not None:  # a restarted elastic rank: the group admits it now
            await asyncio.to_thread(finish_join, engine)
        loop.start(worker.role)
        stack.push_async_callback(loop.stop)
        stack.push_async_callback(worker.role.close)  # before the loop stops, after the server did
        server = await start_grpc_server(
            common.host,
            port,
            [lambda s: spec.add_servicer(worker.servicer, s)],
            [spec.service_name],
            auth=auth,
        )
        stack.push_async_callback(server.stop)
        info = InstanceInfo(
            instance_id,
            Role(spec.role),
            common.address(server.port),
            rank=rank,
            dp_size=size,
            model=Path(model_dir).resolve().name,
            ready=True,
            block_size=engine.kv_layout.block_size if engine_config.enable_prefix_caching else 0,
            metrics_port=common.metrics_port or 0,
            revision=revision.fingerprint,
        )
        report = _LoadReport(loop, info, server.probes, kv=spec.role == "decode")
        server.probes.add_fatal_check(lambda: _engine_ended(loop))
        await stay_registered(
            stack,
            registry,
            report,
            common.heartbeat_s,
            on_missing=lambda: kvstore.register_agent(instance_id, agent.metadata(), instance_id),
        )
        await server.set_serving(True)
        if engine_config.enable_prefix_caching:
            stop_with(stack, start_kv_event_publisher(loop, kvstore, instance_id))
        if dep is not None and dep.eplb_report_s > 0:
            _start_eplb_agent(
                stack,
                loop,
                redis,
                EPLBAgentConfig(
                    common.deployment,
                    base_instance(instance_id, rank, size),
                    rank,
                    size,
                    dep.eplb_report_s,
                ),
            )
        log.info(
            "serving",
            role=spec.role,
            instance=instance_id,
            address=info.address,
            rank=rank,
            dp_size=size,
            kv_blocks=engine.kv_layout.num_blocks,
            speculative=engine.speculative or "off",
            num_speculative_tokens=engine_config.num_spec_tokens,
            revision=revision.fingerprint,
        )
        if ready is not None:
            ready.set()
        await _until_stopped(loop, instance_id, context is not None)


def engine_revision(engine: EngineCore, model_dir: Path, agent: KVTransferAgent) -> Revision:
    """The rank's revision (`pdmesh_service.revision`): its checkpoint (and the draft model's),
    the KV groups its agent registered, the KV pool's dtype, the proposer, `KV_FORMAT_VERSION`."""
    draft = engine.config.draft_model if engine.speculative.startswith("draft_model") else None
    checkpoint = checkpoint_identity(model_dir, *([draft] if draft else []))
    dtypes = {str(t.dtype).removeprefix("torch.") for m in engine.kv_memory() for t in m.tensors}
    dtype = ",".join(sorted(dtypes))
    return Revision(
        revision_parts(checkpoint, agent.groups, dtype, engine.speculative, KV_FORMAT_VERSION)
    )


def _join_dep(
    common: CommonConfig, dep: DEPOptions, instance_id: str
) -> tuple[DEPContext, Callable[[EngineCore], None] | None]:
    """Join the instance's group (blocks until every rank joined). Elastic: the group survives a
    lost rank; a restarted one (`--dep-rejoin`) gets a one-rank context to build its engine with
    and the call that joins the running group once the engine is built."""
    if dep.rank is None:  # run_worker joins only as a rank (`dep.is_rank`)
        raise ValueError("joining a DEP group needs the rank (--dep-rank)")
    master = master_addr(common.host, dep.dist_host)
    config = DEPConfig(
        dep.rank,
        dep.size,
        master,
        dep.dist_port,
        dp_sync=ELASTIC_DP_SYNC if dep.elastic else dep.dp_sync,
        num_redundant_experts=dep.num_redundant_experts,
    )
    if not dep.elastic:
        return init_dep(config), None
    store = membership_store(
        common.redis_url,
        common.deployment,
        base_instance(instance_id, dep.rank, dep.size),
        dep.run_id or str(dep.dist_port),
    )
    elastic = ElasticConfig(dep.rank, dep.size, store, addr=master)
    if dep.rejoin:
        return join_elastic(config, elastic)
    context = init_dep(config)
    context.elastic = ElasticGroup(elastic, context)
    return context, None


def _start_eplb_agent(
    stack: contextlib.AsyncExitStack,
    loop: EngineLoop,
    redis: aioredis.Redis,
    config: EPLBAgentConfig,
) -> None:
    """Run the rank's EPLB agent (worker.eplb_agent) until `stack` closes (first: before Redis and
    the loop)."""
    stop_with(stack, run_eplb_agent(loop, redis, config))


async def _until_stopped(loop: EngineLoop, instance_id: str, dep: bool) -> None:
    """Until cancelled; a DEP rank also ends when its engine loop does (the instance cannot go
    on)."""
    if not dep or loop.ended is None:
        await asyncio.Future()  # until cancelled
        return
    reason = await asyncio.shield(loop.ended)
    raise ServiceStopped(f"{instance_id}: {reason}")


STATUS_WAIT_S = 0.5  # a heartbeat waits this long for the engine's load, then reports the last
ENGINE_SILENT_S = 60.0  # an engine thread that has not answered for this long: reported not ready


def _engine_ended(loop: EngineLoop) -> str | None:
    """Why the engine thread ended (a crash, a device fault), None while it runs: for liveness."""
    if loop.ended is None or not loop.ended.done() or loop.ended.cancelled():
        return None
    return f"the engine loop ended: {loop.ended.result()}"


class _LoadReport:
    """The rank's heartbeat: its info with the engine's latest load. The load comes from the engine
    thread, between steps; a beat waits at most `STATUS_WAIT_S` for it and otherwise reports the
    last one, so a long step (a big prefill chunk on a busy CPU) does not delay the beat and make
    the gateway give the rank up (liveness is the process's, not the step's). An engine thread
    silent for `ENGINE_SILENT_S` is reported `ready=False` (not routable) until it answers. The
    process's probes learn the same (and, for a decode rank, its free KV blocks). Once the probes
    say draining (SIGTERM with --drain-s), every beat says `draining=True`: the gateway sends it
    nothing new but keeps its calls open (a rolling update drains the old revision so)."""

    def __init__(
        self, loop: EngineLoop, info: InstanceInfo, probes: Probes | None = None, kv: bool = False
    ) -> None:
        self.loop, self.info, self.probes, self.kv = loop, info, probes, kv
        self.pending: asyncio.Future[Any] | None = None
        self.answered_at = time.monotonic()

    async def __call__(self) -> InstanceInfo:
        if self.probes is not None and self.probes.draining and not self.info.draining:
            self.info = replace(self.info, draining=True)
        if self.pending is None:
            self.pending = asyncio.ensure_future(self.loop.status())
        try:
            status = await asyncio.wait_for(asyncio.shield(self.pending), STATUS_WAIT_S)
        except TimeoutError:
            silent = time.monotonic() - self.answered_at > ENGINE_SILENT_S
            if self.probes is not None:
                reason = f"the engine has not answered for {ENGINE_SILENT_S:g}s" if silent else None
                self.probes.set_problem("engine", reason)
            return replace(self.info, ready=False) if silent else self.info
        self.pending, self.answered_at = None, time.monotonic()
        if self.probes is not None:
            self.probes.set_problem("engine", None)
            if self.kv:
                self.probes.kv = (status.kv_blocks_free, status.kv_blocks_total)
        self.loop.metrics.observe_load(status.load)
        # dp_size: an elastic instance's group may have re-formed with fewer (or again all) ranks
        self.info = replace(self.info, stats=heartbeat_stats(status), dp_size=status.dp_size)
        return self.info
