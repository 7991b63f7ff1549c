"""The hand-off record as the authority on who may write a decode rank's blocks, for real.

kvstore, decode and prefill run in this process (as in test_workers) with a short quarantine cap;
the test keeps the decode rank's engine loop to read its KV pool, and writes "late" KV into it with
its own NIXL agent. Covered: a prefill whose reservation ended (lease, Cancel) computes but never
writes; a reservation cancelled while TRANSFERRING keeps its blocks out of the pool until the KV
lands or the cap passes; a lease that runs out after a prefill claimed the hand-off does not lose
the request (it waits for its KV until the cap, and only then is dropped); a request id can be
reserved again once its hand-off is final; seeded sampling through Reserve → Prefill → Decode equals
the offline engine. Every test leaves both pools empty and intact.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from test_workers import (
    BLOCK_SIZE,
    GREEDY,
    NUM_BLOCKS,
    PROMPTS,
    RPC_TIMEOUT_S,
    TOKEN_BUDGET,
    Mesh,
    ServiceHost,
    assert_clean,
    disagg,
    expect_code,
    md,
    reserve,
    status,
    wait_for,
)

from pdmesh.tools.model_init import init_model
from pdmesh_engine import LLM, EngineConfig, SamplingParams
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2, decode_pb2_grpc
from pdmesh_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from pdmesh_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from pdmesh_service.handoff import HandoffState
from pdmesh_service.redis_server import EmbeddedRedis, free_port

pytest.importorskip("nixl")

QUARANTINE_S = 5.0  # the decode rank's cap; the tests that beat it take well under a second
S = HandoffState
LONG_PROMPT = [(i * 13) % 1000 + 2 for i in range(NUM_BLOCKS * BLOCK_SIZE - 8)]  # ~24 chunked steps


def _capturing_decode(captured: dict[str, Any]) -> types.SimpleNamespace:
    """The decode server module, but `serve` keeps the rank's parts (engine loop, agent) and its
    worker (connector, servicer) in `captured`."""
    from pdmesh_decode import server
    from pdmesh_service.worker.runtime import WorkerSpec, run_worker

    async def serve(config, ready: asyncio.Event) -> None:
        build = server.build_worker(config)

        def keep(parts):
            captured["parts"], captured["worker"] = parts, build(parts)
            return captured["worker"]

        spec = WorkerSpec(
            server.ROLE, server.SERVICE_NAME, keep, decode_pb2_grpc.add_DecodeServicer_to_server
        )
        await run_worker(
            spec, config.common, config.model_dir, config.engine, config.kvstore, ready
        )

    return types.SimpleNamespace(
        __name__="decode",
        add_arguments=server.add_arguments,
        config_from_args=server.config_from_args,
        serve=serve,
    )


class SafetyMesh(Mesh):
    host: ServiceHost
    decode_parts: Any
    connector: Any

    def on_engine(self, fn, *args) -> Any:
        """`fn(*args)` run in the decode rank's engine thread (the only thread that touches its
        pool)."""

        async def call() -> Any:
            return await self.decode_parts.engine.submit(fn, *args)

        return asyncio.run_coroutine_threadsafe(call(), self.host.loop).result(RPC_TIMEOUT_S)

    def pool_blocks(self, block_ids) -> torch.Tensor:
        pool = self.decode_parts.engine.engine.kv_caches  # [L, N, B, D]
        return self.on_engine(lambda: pool[:, list(block_ids)].clone())

    def handoff(self, request_id: str) -> kvstore_pb2.Handoff:
        return self.handoffs.GetHandoff(
            kvstore_pb2.GetHandoffRequest(request_id=request_id), timeout=RPC_TIMEOUT_S
        )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(
        tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0, verbose=False
    )


@pytest.fixture(scope="module")
def mesh(model_dir: Path) -> Iterator[SafetyMesh]:
    from pdmesh_kvstore import server as kvstore_server
    from pdmesh_prefill import server as prefill_server

    redis, host, captured = EmbeddedRedis().start(), ServiceHost(), {}
    channels: list[grpc.Channel] = []
    try:
        ports = [free_port() for _ in range(3)]
        mesh = SafetyMesh(
            model_dir,
            redis,
            "test-safety",
            f"127.0.0.1:{ports[0]}",
            "decode-s",
            "prefill-s",
            None,
            None,
            None,
        )
        mesh.host = host
        host.start(kvstore_server, mesh.common_args("kvstore-s", ports[0]))
        host.start(
            _capturing_decode(captured),
            [*mesh.worker_args(mesh.decode_id, ports[1]), "--kv-quarantine-s", str(QUARANTINE_S)],
        )
        host.start(prefill_server, mesh.worker_args(mesh.prefill_id, ports[2]))
        mesh.decode_parts, mesh.connector = captured["parts"], captured["worker"].role
        channels = [grpc.insecure_channel(f"127.0.0.1:{p}") for p in ports]
        mesh.handoffs = kvstore_pb2_grpc.KVStoreStub(channels[0])
        mesh.decode, mesh.prefill = (
            decode_pb2_grpc.DecodeStub(channels[1]),
            prefill_pb2_grpc.PrefillStub(channels[2]),
        )
        yield mesh
    finally:
        for ch in channels:
            ch.close()
        host.stop()
        redis.stop()


@pytest.fixture
def writer(mesh: SafetyMesh) -> Iterator[Any]:
    """A NIXL agent of the test's own, over a pool like decode's, connected to the decode rank."""
    from pdmesh_engine.transfer.agent import KVTransferAgent

    decode_pool = mesh.decode_parts.engine.engine.kv_caches
    pool = torch.randn(decode_pool.shape, dtype=decode_pool.dtype)
    agent = KVTransferAgent("test-writer", pool, progress_thread=False)
    try:
        info = mesh.handoffs.GetAgent(
            kvstore_pb2.GetAgentRequest(agent_name=mesh.decode_id), timeout=RPC_TIMEOUT_S
        )
        agent.connect(mesh.decode_id, info.metadata)
        agent.pool = pool
        yield agent
    finally:
        agent.close()


def prefill_call(mesh: SafetyMesh, request_id: str, prompt: list[int], target, sampling=GREEDY):
    return mesh.prefill.Prefill(
        prefill_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling, target=target
        ),
        timeout=RPC_TIMEOUT_S,
        metadata=md(request_id),
    )


def cancel(mesh: SafetyMesh, request_id: str) -> bool:
    return mesh.decode.Cancel(
        decode_pb2.CancelRequest(request_id=request_id), timeout=RPC_TIMEOUT_S
    ).found


def claim(mesh: SafetyMesh, request_id: str) -> None:
    """What a prefill rank does right before its WRITE: RESERVED → TRANSFERRING by
    compare-and-set."""
    mesh.handoffs.UpdateHandoff(
        kvstore_pb2.UpdateHandoffRequest(
            request_id=request_id,
            state=kvstore_pb2.HANDOFF_STATE_TRANSFERRING,
            prefill_instance="test-writer",
            expected_state=kvstore_pb2.HANDOFF_STATE_RESERVED,
        ),
        timeout=RPC_TIMEOUT_S,
    )


# ----- a prefill whose reservation ended never writes -----
def test_prefill_slower_than_the_lease_computes_but_does_not_write(mesh: SafetyMesh) -> None:
    before_d, before_p = status(mesh.decode), status(mesh.prefill)
    target = reserve(mesh, "late", PROMPTS[3], lease_ms=1)  # the lease ends long before any prefill
    content = mesh.pool_blocks(target.groups[0].block_ids)
    wait_for(
        lambda: status(mesh.decode, check=False).lease_expiries == before_d.lease_expiries + 1,
        what="the lease to expire",
    )
    mesh.wait_handoff("late", "EXPIRED")
    assert_clean(mesh.decode)  # freed at once: no WRITE could start
    details = expect_code(
        grpc.StatusCode.ABORTED, lambda: prefill_call(mesh, "late", PROMPTS[3], target)
    )
    assert "ended before the KV was ready" in details
    after_d, after_p = status(mesh.decode), status(mesh.prefill)
    assert (
        after_p.kv_bytes_sent == before_p.kv_bytes_sent
        and after_p.transfer_failures == before_p.transfer_failures
    )
    assert after_d.kv_bytes_received == before_d.kv_bytes_received
    assert after_d.kv_quarantines == before_d.kv_quarantines
    assert torch.equal(mesh.pool_blocks(target.groups[0].block_ids), content)
    assert mesh.handoff_state("late") == "EXPIRED"
    assert_clean(mesh.prefill)
    assert_clean(mesh.decode)


def test_reservation_cancelled_during_prefill_is_not_written(mesh: SafetyMesh) -> None:
    """The client gives up while the prompt runs: decode.Cancel ends the hand-off, the prefill's
    claim fails."""
    sent = status(mesh.prefill).kv_bytes_sent
    target = reserve(mesh, "cancel-mid", LONG_PROMPT)
    content = mesh.pool_blocks(target.groups[0].block_ids)
    future = mesh.prefill.Prefill.future(
        prefill_pb2.PrefillRequest(
            request_id="cancel-mid", prompt_token_ids=LONG_PROMPT, sampling=GREEDY, target=target
        ),
        timeout=RPC_TIMEOUT_S,
    )
    wait_for(
        lambda: status(mesh.prefill, check=False).kv_blocks_used > 0, what="the prefill to start"
    )
    assert cancel(mesh, "cancel-mid")
    assert_clean(mesh.decode)  # RESERVED → CANCELLED: freed at once
    assert mesh.handoff_state("cancel-mid") == "CANCELLED"
    with pytest.raises(grpc.RpcError) as info:
        future.result()
    assert info.value.code() == grpc.StatusCode.ABORTED, "the prefill finished before the cancel"
    assert status(mesh.prefill).kv_bytes_sent == sent
    assert torch.equal(mesh.pool_blocks(target.groups[0].block_ids), content)
    assert_clean(mesh.prefill)


# ----- quarantine -----
def test_cancel_while_transferring_holds_the_blocks_until_the_kv_lands(
    mesh: SafetyMesh, writer
) -> None:
    before = status(mesh.decode)
    target = reserve(mesh, "in-flight", PROMPTS[3])
    blocks = list(target.groups[0].block_ids)
    claim(mesh, "in-flight")
    assert cancel(mesh, "in-flight")  # answers once the blocks are quarantined
    held = status(mesh.decode)
    assert held.kv_quarantines == before.kv_quarantines + 1 and held.integrity_error == ""
    assert held.kv_blocks_used == len(blocks)
    assert mesh.handoff_state("in-flight") == "CANCELLED"
    other = reserve(mesh, "meanwhile", PROMPTS[3])  # quarantined blocks are not handed out again
    assert not set(other.groups[0].block_ids) & set(blocks)
    expect_code(grpc.StatusCode.UNAVAILABLE, lambda: reserve(mesh, "in-flight", PROMPTS[0]))
    assert cancel(mesh, "meanwhile")
    assert status(mesh.decode).kv_blocks_used == len(blocks)
    from pdmesh_engine.transfer.pb import layout_from_pb

    local = list(range(len(blocks)))  # the late WRITE, notification = request id
    transfer = writer.write(
        "in-flight", local, mesh.decode_id, layout_from_pb(target.groups[0].pools[0]), blocks
    )
    assert writer.wait(transfer, timeout_s=RPC_TIMEOUT_S) == "DONE"
    assert_clean(mesh.decode)
    # it landed where nobody else was
    assert torch.equal(mesh.pool_blocks(blocks), writer.pool[:, local])
    assert status(mesh.decode).kv_bytes_received == before.kv_bytes_received


def test_quarantine_ends_at_the_cap_without_a_notification(mesh: SafetyMesh) -> None:
    before = status(mesh.decode).kv_quarantines
    target = reserve(mesh, "never-lands", PROMPTS[2])
    claim(mesh, "never-lands")
    assert cancel(mesh, "never-lands")
    assert status(mesh.decode).kv_blocks_used == len(target.groups[0].block_ids)
    wait_for(
        lambda: status(mesh.decode, check=False).kv_blocks_used == 0,
        timeout_s=QUARANTINE_S + 10,
        what="the quarantine cap",
    )
    assert status(mesh.decode).kv_quarantines == before + 1
    assert_clean(mesh.decode)
    tokens, _, _ = disagg(mesh, "never-lands", PROMPTS[2])  # the id is usable again
    assert len(tokens) == GREEDY.max_tokens
    assert_clean(mesh.decode)


# ----- a lease that runs out after a prefill claimed the hand-off -----
@pytest.fixture
def held_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, threading.Event]]:
    """Prefill WRITEs of the request ids put in here wait (after their claim) until their event is
    set."""
    from pdmesh_prefill.pusher import KVPusher

    held: dict[str, threading.Event] = {}
    write = KVPusher.write

    def held_write(self, request_id: str, target):
        gate = held.get(request_id)
        if gate is None:
            return write(self, request_id, target)

        async def later():
            await asyncio.get_running_loop().run_in_executor(None, gate.wait, RPC_TIMEOUT_S)
            return await write(self, request_id, target)

        return asyncio.ensure_future(later())

    monkeypatch.setattr(KVPusher, "write", held_write)
    yield held
    for gate in held.values():
        gate.set()


def run_lease_out(mesh: SafetyMesh, request_id: str) -> None:
    """End the reservation's lease now, as a prefill queue longer than the lease does."""
    mesh.on_engine(lambda: mesh.connector.book.leases.add(request_id, 0.0))


def waits_past_its_lease(mesh: SafetyMesh, request_id: str) -> bool:
    from pdmesh_decode.core import ReservationState

    def extended() -> bool:
        reservation = mesh.connector.book.get(request_id)
        return reservation is not None and reservation.state is ReservationState.EXTENDED

    return mesh.on_engine(extended)


def decode_call(mesh: SafetyMesh, request_id: str, first_token: common_pb2.TokenLogprob):
    return mesh.decode.Decode(
        decode_pb2.DecodeRequest(request_id=request_id, first_token=first_token),
        timeout=RPC_TIMEOUT_S,
        metadata=md(request_id),
    )


def test_lease_running_out_while_the_write_is_in_flight_still_completes(
    mesh: SafetyMesh, held_writes
) -> None:
    expected, _, _ = disagg(mesh, "lapse-ref", PROMPTS[2])
    before = status(mesh.decode)
    held_writes["lapse"] = gate = threading.Event()
    target = reserve(mesh, "lapse", PROMPTS[2])
    prefill = mesh.prefill.Prefill.future(
        prefill_pb2.PrefillRequest(
            request_id="lapse", prompt_token_ids=PROMPTS[2], sampling=GREEDY, target=target
        ),
        timeout=RPC_TIMEOUT_S,
    )
    mesh.wait_handoff("lapse", "TRANSFERRING")  # claimed; its WRITE waits for `gate`
    run_lease_out(mesh, "lapse")
    wait_for(
        lambda: waits_past_its_lease(mesh, "lapse"), what="the reservation to outlive its lease"
    )
    held = status(mesh.decode)
    assert (
        held.lease_expiries == before.lease_expiries + 1
        and held.kv_quarantines == before.kv_quarantines
    )
    assert (
        held.kv_blocks_used == len(target.groups[0].block_ids)
        and mesh.handoff_state("lapse") == "TRANSFERRING"
    )
    gate.set()
    response = prefill.result()
    chunks = list(decode_call(mesh, "lapse", response.first_token))
    assert [response.first_token.token_id] + [t for c in chunks for t in c.token_ids] == expected
    mesh.wait_handoff("lapse", "CONSUMED")
    assert_clean(mesh.decode)
    assert_clean(mesh.prefill)


def test_lease_running_out_after_the_kv_landed_waits_for_the_decode_call(mesh: SafetyMesh) -> None:
    expected, _, _ = disagg(mesh, "landed-ref", PROMPTS[1])
    target = reserve(mesh, "landed", PROMPTS[1])
    response = prefill_call(mesh, "landed", PROMPTS[1], target)
    run_lease_out(mesh, "landed")
    wait_for(
        lambda: waits_past_its_lease(mesh, "landed"), what="the reservation to outlive its lease"
    )
    chunks = list(decode_call(mesh, "landed", response.first_token))
    assert [response.first_token.token_id] + [t for c in chunks for t in c.token_ids] == expected
    mesh.wait_handoff("landed", "CONSUMED")
    assert_clean(mesh.decode)


def test_claimed_reservation_whose_kv_never_comes_is_dropped_at_the_cap(mesh: SafetyMesh) -> None:
    target = reserve(mesh, "never-written", PROMPTS[1])
    claim(mesh, "never-written")
    waiting = decode_call(mesh, "never-written", common_pb2.TokenLogprob(token_id=5))
    run_lease_out(mesh, "never-written")
    wait_for(
        lambda: waits_past_its_lease(mesh, "never-written"),
        what="the reservation to outlive its lease",
    )
    assert status(mesh.decode).kv_blocks_used == len(target.groups[0].block_ids)
    wait_for(
        lambda: status(mesh.decode, check=False).kv_blocks_used == 0,
        timeout_s=QUARANTINE_S + 10,
        what="the cap",
    )
    with pytest.raises(grpc.RpcError) as info:
        list(waiting)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
    mesh.wait_handoff("never-written", "EXPIRED")
    assert_clean(mesh.decode)


# ----- hand-off records: retries and idempotence -----
def test_a_final_handoff_can_be_opened_again_and_a_live_one_cannot(mesh: SafetyMesh) -> None:
    from prometheus_client import REGISTRY

    def opened(decode_instance: str) -> kvstore_pb2.Handoff:
        return mesh.handoffs.OpenHandoff(
            kvstore_pb2.OpenHandoffRequest(
                request_id="reopen", decode_instance=decode_instance, num_blocks=2, lease_ms=1000
            ),
            timeout=RPC_TIMEOUT_S,
        )

    def update(state: int, expected: int = 0) -> kvstore_pb2.Handoff:
        return mesh.handoffs.UpdateHandoff(
            kvstore_pb2.UpdateHandoffRequest(
                request_id="reopen", state=state, expected_state=expected
            ),
            timeout=RPC_TIMEOUT_S,
        )

    def cancelled_count() -> float:
        return (
            REGISTRY.get_sample_value("pdmesh_kvstore_handoffs_total", {"state": "CANCELLED"})
            or 0.0
        )

    assert opened("decode-a").state == kvstore_pb2.HANDOFF_STATE_RESERVED
    expect_code(grpc.StatusCode.FAILED_PRECONDITION, lambda: opened("decode-b"))  # live
    expect_code(
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: update(
            kvstore_pb2.HANDOFF_STATE_CANCELLED, expected=kvstore_pb2.HANDOFF_STATE_TRANSFERRING
        ),
    )  # CAS miss
    first = update(kvstore_pb2.HANDOFF_STATE_CANCELLED)
    count = cancelled_count()
    again = update(kvstore_pb2.HANDOFF_STATE_CANCELLED)  # idempotent
    assert again == first and cancelled_count() == count
    expect_code(
        grpc.StatusCode.FAILED_PRECONDITION, lambda: update(kvstore_pb2.HANDOFF_STATE_READY)
    )
    reopened = opened("decode-b")  # a retry
    assert (
        reopened.state == kvstore_pb2.HANDOFF_STATE_RESERVED
        and reopened.decode_instance == "decode-b"
    )
    assert reopened.prefill_instance == ""


def test_a_write_computed_for_a_replaced_record_does_not_apply(mesh: SafetyMesh) -> None:
    """Compare-and-set is per incarnation: a retry's record in the same state is another record (no
    ABA)."""
    from pdmesh_kvstore.store import KVStore
    from pdmesh_service.registry import connect

    async def body() -> tuple[int, S]:
        client = connect(mesh.redis.url)
        try:
            store = KVStore(client, "test-safety-aba")
            await store.open_handoff("aba", "decode-a", 1, 5000)
            old, epoch = await store._read("aba")  # a transition reads the first incarnation
            await store.update_handoff("aba", S.CANCELLED)
            await store.open_handoff("aba", "decode-b", 3, 5000)  # the retry: RESERVED again
            stale = await store._cas(
                keys=[store.handoff_key("aba")],
                args=[old.state.name, epoch, 5000, "state", "TRANSFERRING"],
            )
            return stale, (await store.get_handoff("aba")).state
        finally:
            await client.aclose()

    assert asyncio.run(body()) == (0, S.RESERVED)


def test_live_handoff_outlives_its_lease_by_the_grace_period(mesh: SafetyMesh) -> None:
    import redis as redis_lib

    from pdmesh_service.registry import namespace

    reserve(mesh, "grace", PROMPTS[0], lease_ms=2000)
    client = redis_lib.Redis.from_url(mesh.redis.url)
    try:
        ttl = client.pttl(f"{namespace(mesh.deployment)}:handoff:grace")
    finally:
        client.close()
    assert 30_000 < ttl <= 32_000  # lease 2 s + grace 30 s
    assert cancel(mesh, "grace")
    assert_clean(mesh.decode)


def test_reserve_again_under_the_same_id_after_a_cancel(mesh: SafetyMesh) -> None:
    """What the gateway does after a failed prefill: Cancel, then Reserve the same id (on any
    rank)."""
    reserve(mesh, "retry", PROMPTS[1])
    assert cancel(mesh, "retry")
    assert mesh.handoff_state("retry") == "CANCELLED"
    tokens, _, _ = disagg(mesh, "retry", PROMPTS[1])
    assert len(tokens) == GREEDY.max_tokens
    mesh.wait_handoff("retry", "CONSUMED")
    assert_clean(mesh.decode)
    assert_clean(mesh.prefill)


# ----- seeded sampling -----
def test_seeded_sampling_is_the_same_disaggregated_aggregated_and_offline(mesh: SafetyMesh) -> None:
    sampling = common_pb2.SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True)
    llm = LLM(
        mesh.model,
        EngineConfig(
            block_size=BLOCK_SIZE,
            num_blocks=NUM_BLOCKS,
            device="cpu",
            dtype="float32",
            max_num_batched_tokens=TOKEN_BUDGET,
            max_num_seqs=8,
        ),
    )
    prompts = [PROMPTS[1], PROMPTS[3]]
    offline = [
        o.token_ids
        for o in llm.generate(
            prompts, SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True)
        )
    ]
    greedy = llm.generate(
        prompts[:1], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )[0].token_ids
    assert offline[0] != greedy, "the seed must make a difference for this check to mean anything"
    for i, prompt in enumerate(prompts):
        assert disagg(mesh, f"seeded-{i}", prompt, sampling=sampling)[0] == offline[i], (
            f"disagg, prompt {i}"
        )
        chunks = mesh.decode.Generate(
            decode_pb2.GenerateRequest(
                request_id=f"seeded-agg-{i}", prompt_token_ids=prompt, sampling=sampling
            ),
            timeout=RPC_TIMEOUT_S,
        )
        assert [t for c in chunks for t in c.token_ids] == offline[i], f"agg, prompt {i}"
    assert_clean(mesh.decode)
    assert_clean(mesh.prefill)


# ----- pure parts -----
class FakeKVStore:
    """`update_handoff(expected=...)`/`get_handoff` over one record, or raising `error` for every
    call."""

    def __init__(self, state: S | None, error: BaseException | None = None) -> None:
        self.state, self.error, self.calls = state, error, 0

    async def update_handoff(
        self, request_id: str, state: S, prefill_instance: str = "", expected: S | None = None
    ) -> None:
        from pdmesh_service.errors import FailedPrecondition, NotFound

        self.calls += 1
        if self.error is not None:
            raise self.error
        if self.state is None:
            raise NotFound(request_id)
        if expected is not None and self.state != expected:
            raise FailedPrecondition(f"{self.state.name}, not {expected.name}")
        self.state = state

    async def get_handoff(self, request_id: str) -> Any:
        from pdmesh_service.errors import NotFound

        if self.state is None:
            raise NotFound(request_id)
        return argparse.Namespace(state=self.state, prefill_instance="")


@pytest.mark.parametrize(
    "state,ended_from,written",
    [
        (S.RESERVED, S.RESERVED, False),
        (S.TRANSFERRING, S.TRANSFERRING, True),
        (S.READY, S.READY, False),
        (S.CANCELLED, S.CANCELLED, False),
        (S.EXPIRED, S.EXPIRED, False),
        (None, None, True),
    ],
)
def test_end_handoff_reports_where_it_ended_from(state, ended_from, written) -> None:
    from pdmesh_service.handoff import may_be_written
    from pdmesh_service.kvstore_client import end_handoff

    store = FakeKVStore(state)
    assert asyncio.run(end_handoff(store, "r", S.EXPIRED)) == ended_from
    assert may_be_written(ended_from) is written
    if state is not None and not state.terminal:
        assert store.state == S.EXPIRED


def test_unreachable_kvstore_means_quarantine() -> None:
    from pdmesh_service.errors import Unavailable
    from pdmesh_service.handoff import may_be_written
    from pdmesh_service.kvstore_client import RetryPolicy, end_handoff

    quick = RetryPolicy(budget_s=0.2)
    assert may_be_written(
        asyncio.run(
            end_handoff(FakeKVStore(S.RESERVED, Unavailable("down")), "r", S.CANCELLED, quick)
        )
    )
    assert may_be_written(
        asyncio.run(
            end_handoff(FakeKVStore(S.RESERVED, ConnectionError()), "r", S.CANCELLED, quick)
        )
    )


def test_reservation_lease_runs_from_publish() -> None:
    from pdmesh_decode.core import (
        LeaseAction,
        Reservation,
        ReservationBook,
        ReservationEvent,
        ReservationState,
    )

    E = ReservationEvent
    book = ReservationBook()
    book.add(Reservation("r", 1, 3, lease_s=5.0, cap_s=3.0))
    assert book.due(1e9) == [] and book.get("r").state is ReservationState.HELD  # no lease yet
    assert book.apply("r", E.PUBLISHED, now=0.0).until == 5.0
    assert book.due(4.9) == [] and book.due(5.0) == ["r"] and "r" in book  # kept until decided
    assert book.due(1e9) == []  # no lease runs any more
    assert book.apply("r", E.DEADLINE, now=5.0).action is LeaseAction.ASK_KVSTORE
    assert book.apply("r", E.KV_MAY_ARRIVE, now=5.0).until == 8.0 and book.due(7.9) == []
    assert book.get("r").state is ReservationState.EXTENDED and book.due(8.0) == ["r"]
    assert book.apply("r", E.DEADLINE, now=8.0).action is LeaseAction.END_CLAIMED
    assert book.apply("r", E.KV_WONT_ARRIVE, now=8.0).action is LeaseAction.DROP and "r" not in book
