"""The kvstore for real: embedded Redis, the gRPC server on 127.0.0.1 (port 0), the async client.

Each test runs `serve()` in its own event loop under a fresh deployment namespace, finds the server
through the registry (as workers do), and talks to it through `KVStoreClient` or a raw stub.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator
from itertools import pairwise
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from pdmesh_kvstore import server as kvstore_server
from pdmesh_kvstore.store import KVStore
from pdmesh_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from pdmesh_service.errors import FailedPrecondition, InvalidArgument, NotFound
from pdmesh_service.handoff import TERMINAL, TRANSITIONS, Handoff, HandoffState, check_transition
from pdmesh_service.kvstore_client import KVStoreClient
from pdmesh_service.redis_server import EmbeddedRedis
from pdmesh_service.registry import Registry, connect

S = HandoffState


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as redis:
        yield redis.url


def _run(
    redis_url: str,
    body: Callable[..., Awaitable[Any]],
    retention_s: float = 60.0,
    grace_s: float = 30.0,
) -> Any:
    """Start a kvstore, run `body(client, ctx)`, stop it.

    ctx: address, info (its registry entry), redis, registry, store (a second store on the same
    keys), channel (for raw stubs); after_stop is set to the registry's kvstore entries once it
    stopped.
    """
    deployment = f"t-{uuid.uuid4().hex[:8]}"
    parser = argparse.ArgumentParser()
    kvstore_server.add_arguments(parser)
    config = kvstore_server.config_from_args(
        parser.parse_args(
            [
                "--redis-url",
                redis_url,
                "--deployment",
                deployment,
                "--heartbeat-s",
                "0.2",
                "--handoff-retention-s",
                str(retention_s),
                "--handoff-grace-s",
                str(grace_s),
            ]
        )
    )

    async def main() -> Any:
        ready = asyncio.Event()
        task = asyncio.ensure_future(kvstore_server.serve(config, ready))
        await asyncio.wait_for(ready.wait(), 20)
        redis = connect(redis_url)
        registry = Registry(redis, deployment)
        [info] = await registry.instances("kvstore")
        client = KVStoreClient(info.address)
        ctx = argparse.Namespace(
            address=info.address,
            redis=redis,
            registry=registry,
            info=info,
            store=KVStore(redis, deployment),
            channel=grpc.aio.insecure_channel(info.address),
        )
        try:
            return await body(client, ctx)
        finally:
            await client.close()
            await ctx.channel.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            ctx.after_stop = await registry.instances("kvstore")
            await redis.aclose()

    return asyncio.run(asyncio.wait_for(main(), 60))


def _count(state: str) -> float:
    return REGISTRY.get_sample_value("pdmesh_kvstore_handoffs_total", {"state": state}) or 0.0


# ----- pure core -----
def test_transition_table_is_exactly_the_documented_one():
    legal = {
        (S.RESERVED, S.TRANSFERRING),
        (S.RESERVED, S.READY),
        (S.RESERVED, S.CANCELLED),
        (S.RESERVED, S.EXPIRED),
        (S.TRANSFERRING, S.READY),
        (S.TRANSFERRING, S.CANCELLED),
        (S.TRANSFERRING, S.EXPIRED),
        (S.READY, S.CONSUMED),
        (S.READY, S.CANCELLED),
        (S.READY, S.EXPIRED),
    }
    for old in S:
        for new in S:
            if (old, new) in legal:
                check_transition(old, new)
            else:
                with pytest.raises(FailedPrecondition, match=f"from {old.name} to {new.name}"):
                    check_transition(old, new)
    assert TERMINAL == {s for s in S if not TRANSITIONS[s]} == {S.CONSUMED, S.EXPIRED, S.CANCELLED}
    assert {s.name: int(s) for s in S} == {
        kvstore_pb2.HandoffState.Name(v)[len("HANDOFF_STATE_") :]: v
        for v in kvstore_pb2.HandoffState.values()
        if v
    }


def test_handoff_round_trips_through_redis_fields_and_protobuf():
    h = Handoff("r1", S.TRANSFERRING, "decode-0", "prefill-1", 7, 300, 12345)
    assert Handoff.from_fields({k.encode(): v.encode() for k, v in h.to_fields().items()}) == h
    assert Handoff.from_message(kvstore_pb2.Handoff(**h.message_fields())) == h


def test_core_imports_no_grpc_redis_or_nixl():
    code = (
        "import sys, pdmesh_kvstore.core; "
        "print(sorted(m for m in ('grpc', 'redis', 'nixl', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


# ----- through the server -----
def test_agents_register_and_resolve(redis_url):
    metadata = bytes(range(256)) * 4  # not text: must survive as bytes

    async def body(client: KVStoreClient, ctx) -> None:
        await client.register_agent("decode-0", metadata, "decode-0")
        assert await client.get_agent("decode-0") == metadata
        assert (await ctx.store.get_agent("decode-0"))[1] == "decode-0"
        with pytest.raises(NotFound, match="ghost"):
            await client.get_agent("ghost")
        with pytest.raises(InvalidArgument):
            await client.register_agent("", metadata, "x")
        async with grpc.aio.insecure_channel(ctx.address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=kvstore_server.SERVICE_NAME)
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert ctx.info.role == "kvstore" and ctx.info.ready
        return ctx

    ctx = _run(redis_url, body)
    assert ctx.after_stop == []  # deregistered when stopped


def test_full_handoff_lifecycle(redis_url):
    before = {s: _count(s) for s in ("RESERVED", "TRANSFERRING", "READY", "CONSUMED")}

    async def body(client: KVStoreClient, ctx) -> list[Handoff]:
        steps = [await client.open_handoff("req-1", "decode-0", 3, 5000)]
        steps.append(
            await client.update_handoff(
                "req-1", kvstore_pb2.HANDOFF_STATE_TRANSFERRING, "prefill-0"
            )
        )
        steps.append(await client.update_handoff("req-1", S.READY))
        steps.append(await client.update_handoff("req-1", "CONSUMED"))
        steps.append(await client.get_handoff("req-1"))
        return steps

    steps = _run(redis_url, body)
    assert [h.state for h in steps] == [S.RESERVED, S.TRANSFERRING, S.READY, S.CONSUMED, S.CONSUMED]
    assert steps[-1] == steps[-2]
    last = steps[-1]
    assert (last.decode_instance, last.prefill_instance, last.num_blocks, last.lease_ms) == (
        "decode-0",
        "prefill-0",
        3,
        5000,
    )
    assert steps[0].prefill_instance == "" and all(
        a.updated_ms <= b.updated_ms for a, b in pairwise(steps)
    )
    assert all(_count(s) == before[s] + 1 for s in before)


def test_illegal_transitions_and_duplicates_are_failed_precondition(redis_url):
    async def body(client: KVStoreClient, ctx) -> None:
        stub = kvstore_pb2_grpc.KVStoreStub(ctx.channel)
        await client.open_handoff("req-2", "decode-0", 1, 5000)
        with pytest.raises(FailedPrecondition, match="RESERVED to CONSUMED"):
            await client.update_handoff("req-2", S.CONSUMED)
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await stub.UpdateHandoff(
                kvstore_pb2.UpdateHandoffRequest(
                    request_id="req-2", state=kvstore_pb2.HANDOFF_STATE_CONSUMED
                )
            )
        assert raw.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(FailedPrecondition, match="already exists"):
            await client.open_handoff("req-2", "decode-1", 1, 5000)
        await client.update_handoff("req-2", S.CANCELLED)
        with pytest.raises(FailedPrecondition, match="final"):
            await client.update_handoff("req-2", S.READY)
        with pytest.raises(InvalidArgument):
            await client.open_handoff("req-3", "decode-0", 0, 5000)
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await stub.UpdateHandoff(kvstore_pb2.UpdateHandoffRequest(request_id="req-2", state=0))
        assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (await client.get_handoff("req-2")).state == S.CANCELLED

    _run(redis_url, body)


def test_unknown_handoff_is_not_found(redis_url):
    async def body(client: KVStoreClient, ctx) -> None:
        stub = kvstore_pb2_grpc.KVStoreStub(ctx.channel)
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await stub.GetHandoff(kvstore_pb2.GetHandoffRequest(request_id="nope"))
        assert raw.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(NotFound, match="nope"):
            await client.update_handoff("nope", S.READY)

    _run(redis_url, body)


def test_lease_plus_grace_is_a_ttl_renewed_on_change_and_a_forgotten_reservation_disappears(
    redis_url,
):
    async def body(client: KVStoreClient, ctx) -> tuple[int, int, S, bool]:
        await client.open_handoff("short", "decode-0", 1, 300)
        await client.open_handoff("renewed", "decode-0", 1, 4000)
        first_ttl = await ctx.redis.pttl(ctx.store.handoff_key("short"))
        present = (await client.get_handoff("short")).state
        await asyncio.sleep(0.5)
        await client.update_handoff("renewed", S.TRANSFERRING, "prefill-0")
        renewed_ttl = await ctx.redis.pttl(ctx.store.handoff_key("renewed"))
        for _ in range(50):  # Redis expires lazily or within ~100 ms
            try:
                await client.get_handoff("short")
            except NotFound:
                return first_ttl, renewed_ttl, present, True
            await asyncio.sleep(0.1)
        return first_ttl, renewed_ttl, present, False

    first_ttl, renewed_ttl, present, gone = _run(redis_url, body, grace_s=0.2)
    assert 300 < first_ttl <= 500 and present == S.RESERVED and gone  # lease 300 + grace 200
    assert renewed_ttl > 3600 + 200  # reset to the full lease (+ grace) by the change


def test_finished_handoff_is_retained_past_its_lease(redis_url):
    async def body(client: KVStoreClient, ctx) -> tuple[S, int]:
        await client.open_handoff("done", "decode-0", 2, 300)
        await client.update_handoff("done", S.CANCELLED)
        await asyncio.sleep(0.6)  # twice the lease
        return (await client.get_handoff("done")).state, await ctx.redis.pttl(
            ctx.store.handoff_key("done")
        )

    state, ttl = _run(redis_url, body, retention_s=30)
    assert state == S.CANCELLED and 25_000 < ttl <= 30_000


def test_racing_updates_apply_exactly_one(redis_url):
    async def body(client: KVStoreClient, ctx) -> list[list[bool]]:
        outcomes = []
        for i in range(8):
            rid = f"race-{i}"
            await ctx.store.open_handoff(rid, "decode-0", 1, 5000)
            await ctx.store.update_handoff(rid, S.READY)
            results = await asyncio.gather(
                ctx.store.update_handoff(rid, S.CONSUMED),
                client.update_handoff(rid, S.CANCELLED),
                return_exceptions=True,
            )
            outcomes.append([not isinstance(r, BaseException) for r in results])
            assert all(isinstance(r, (Handoff, FailedPrecondition)) for r in results), results
            final = (await ctx.store.get_handoff(rid)).state
            assert final == [S.CONSUMED, S.CANCELLED][outcomes[-1].index(True)]
        return outcomes

    assert all(sum(o) == 1 for o in _run(redis_url, body))
