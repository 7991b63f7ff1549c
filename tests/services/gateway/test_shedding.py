"""No congestion collapse at the gateway: admission is event-driven (a grant touches the queue
heads, never every waiter; a waiting request costs nothing), the router tells waiters about ranks
leaving instead of being polled, and a full queue sheds new requests at once with 429 and
Retry-After (REST, in the OpenAI error shape the `openai` SDK reads) or RESOURCE_EXHAUSTED (gRPC),
counted in /metrics and /mesh."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from test_gateway_core import SCRIPT_TEXT, FakeDecode, FakePrefill, _mesh, _run, _serve_fakes

from pdmesh_gateway.admission import PrefillAdmission, QueueLimits, Shed
from pdmesh_gateway.orchestrator import GatewayMetrics, Orchestrator
from pdmesh_gateway.rest import create_app
from pdmesh_gateway.retry import RankGone
from pdmesh_gateway.router import Router
from pdmesh_gateway.server import _start_http
from pdmesh_gateway.servicer import GenerateServicer, add_to_server
from pdmesh_proto.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pdmesh_service.grpc_server import start_grpc_server
from pdmesh_service.registry import InstanceInfo


class Counted:
    """A waiter's `ranks()` that counts its calls."""

    def __init__(self, ranks: list[str]) -> None:
        self.ranks, self.calls = ranks, 0

    def __call__(self) -> list[str]:
        self.calls += 1
        return list(self.ranks)


def test_a_grant_touches_no_waiter_but_the_one_granted() -> None:
    async def scenario() -> None:
        gate = PrefillAdmission(limit=2)
        up = ["p0", "p1"]
        held = [await gate.acquire(Counted(up)) for _ in range(4)]
        assert sorted(held) == ["p0", "p0", "p1", "p1"]
        readers = [Counted(up) for _ in range(800)]
        choosers = [(Counted(up), lambda rs, i=i: (rs[i % 2], 10)) for i in range(200)]
        waiters = [asyncio.ensure_future(gate.acquire(r)) for r in readers]
        waiters += [asyncio.ensure_future(gate.acquire(r, c)) for r, c in choosers]
        await asyncio.sleep(0.3)  # waiting: nobody wakes, nobody re-reads its ranks
        every = readers + [r for r, _ in choosers]
        assert gate.waiting == 1000 and all(r.calls == 1 for r in every)
        gate.release("p1")
        await asyncio.sleep(0)
        assert [w.done() for w in waiters].index(True) == 0 and sum(w.done() for w in waiters) == 1
        assert waiters[0].result() == "p1" and all(r.calls == 1 for r in every)
        gate.release("p0")  # the oldest that may take p0: reader 1 (older than any chooser)
        await asyncio.sleep(0)
        assert waiters[1].result() == "p0" and all(r.calls == 1 for r in every)
        for w in waiters[2:]:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert gate.waiting == 0 and gate.queued_tokens("p0") == gate.queued_tokens("p1") == 0

    _run(scenario())


def test_a_new_rank_takes_waiters_at_once_in_arrival_order() -> None:
    async def scenario() -> None:
        gate = PrefillAdmission(limit=1)
        up = ["p0"]
        assert await gate.acquire(Counted(up)) == "p0"
        sticky = asyncio.ensure_future(gate.acquire(Counted(up), lambda rs: (rs[-1], 7)))
        plain = asyncio.ensure_future(gate.acquire(Counted(up)))
        await asyncio.sleep(0.01)
        assert gate.queued_tokens("p0") == 7 and not sticky.done() and not plain.done()
        up.append("p1")  # the router's membership event
        gate.refresh(num_ranks=2)
        # the chooser chose again (its last usable rank, now p1); the plain one still waits on p0
        assert await sticky == "p1" and gate.queued_tokens("p1") == 7 and not plain.done()
        up.clear()  # every rank gone: the waiter does without a prefill rank
        gate.refresh(num_ranks=0)
        assert await plain is None and gate.waiting == 0

    _run(scenario())


def test_a_full_queue_sheds_new_requests_but_not_retries() -> None:
    async def scenario() -> None:
        gate = PrefillAdmission(limit=1, limits=QueueLimits(max_queued=2))
        ranks = Counted(["p0"])
        assert gate.max_queued == 2
        assert await gate.acquire(ranks, bounded=True) == "p0"
        queued = [asyncio.ensure_future(gate.acquire(ranks, bounded=True)) for _ in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(Shed) as info:
            await gate.acquire(ranks, bounded=True)
        shed = info.value
        assert (shed.http_status, shed.reason, shed.code) == (429, "full", "queue_full")
        assert shed.retry_after_header == "1" and "--max-queued 2" in str(shed)
        retry = asyncio.ensure_future(gate.acquire(ranks))  # not bounded: a retry joins
        await asyncio.sleep(0.01)
        assert gate.waiting == 3 and gate.num_shed == {"full": 1, "wait": 0}
        for _ in range(3):
            gate.release("p0")
            await asyncio.sleep(0)
        assert [await q for q in queued] == ["p0", "p0"] and await retry == "p0"

    _run(scenario())


def test_the_default_bound_follows_the_prefill_slots() -> None:
    gate = PrefillAdmission(limit=2)
    assert gate.max_queued == 16  # 8 per slot, one rank until told
    gate.refresh(num_ranks=3)
    assert gate.max_queued == 48
    with pytest.raises(ValueError, match="--max-queued"):
        QueueLimits(max_queued=0)
    with pytest.raises(ValueError, match="--max-queue-wait-s"):
        QueueLimits(max_wait_s=0)


def test_a_wait_longer_than_the_bound_is_shed_with_the_excess_as_retry_after() -> None:
    async def scenario() -> None:
        gate = PrefillAdmission(limit=1, limits=QueueLimits(max_queued=100, max_wait_s=0.5))
        ranks = Counted(["p0"])
        assert gate.estimated_wait_s() is None  # no grant yet: no rate, no wait bound
        for _ in range(4):  # 4 grants 20 ms apart: the queue drains ~40-50 a second
            assert await gate.acquire(ranks, bounded=True) == "p0"
            await asyncio.sleep(0.02)
            gate.release("p0")
        assert await gate.acquire(ranks) == "p0"
        queued = [asyncio.ensure_future(gate.acquire(ranks)) for _ in range(60)]
        await asyncio.sleep(0)
        wait = gate.estimated_wait_s()
        assert wait is not None and wait > 0.5
        with pytest.raises(Shed) as info:
            gate.check_room()
        assert info.value.reason == "wait" and gate.num_shed["wait"] == 1
        assert int(info.value.retry_after_header) >= 1
        for q in queued:
            q.cancel()
        await asyncio.gather(*queued, return_exceptions=True)

    _run(scenario())


def _info(name: str, updated_ms: int = 1) -> InstanceInfo:
    return InstanceInfo(name, name.split("-")[0], "127.0.0.1:1", ready=True, updated_ms=updated_ms)


def test_the_router_announces_membership_departures_and_views() -> None:
    async def scenario() -> None:
        router = Router(gone_after_s=0.0)
        changes: list[int] = []
        router.on_membership(lambda: changes.append(len(router.snapshot())))
        router.update([_info("decode-0"), _info("prefill-0")])
        router.update([_info("decode-0", 2), _info("prefill-0", 2)])  # heartbeats only
        assert changes == [2]
        gone, view = router.departure("prefill-0"), router.next_view()
        assert not gone.done() and not view.done()
        router.update([_info("decode-0", 3)])
        assert gone.done() and view.done() and changes == [2, 1]
        assert router.departure("prefill-0").done()  # gone already: done at once

    _run(scenario())


def test_an_open_call_is_abandoned_when_its_rank_leaves_without_polling() -> None:
    from pdmesh_gateway.start import while_live

    async def scenario() -> None:
        router = Router(gone_after_s=0.0)
        router.update([_info("decode-0")])
        call = asyncio.ensure_future(asyncio.sleep(30))
        watcher = asyncio.ensure_future(while_live(router, call, "decode-0"))
        await asyncio.sleep(0.05)
        assert not watcher.done()
        router.update([])
        with pytest.raises(RankGone) as info:
            await asyncio.wait_for(watcher, 1)
        assert info.value.instance_id == "decode-0" and call.cancelled()

    _run(scenario())


def test_a_full_gateway_answers_429_with_retry_after_over_rest_and_grpc(tok, model) -> None:
    script = tok.encode(SCRIPT_TEXT, add_special_tokens=False)

    async def main() -> None:
        decode, prefill = FakeDecode(script), FakePrefill(script, delay=0.4)
        server, address = await _serve_fakes(decode, prefill)
        registry = CollectorRegistry()
        orch = Orchestrator(
            _mesh({"decode-0": address, "prefill-0": address}),
            tok,
            metrics=GatewayMetrics(registry),
            max_prefill_inflight=1,
            queue_limits=QueueLimits(max_queued=1),
        )
        app = create_app(orch, tok, model, registry)
        http, task, port = await _start_http(app, "127.0.0.1", 0)
        grpc_server = await start_grpc_server(
            "127.0.0.1", 0, [lambda s: add_to_server(GenerateServicer(orch, tok, model), s)], []
        )
        try:
            await _check_shedding(orch, f"http://127.0.0.1:{port}", grpc_server.port)
        finally:
            http.should_exit = True
            await task
            await grpc_server.stop(None)
            await orch.close()
            await server.stop(None)
        assert orch.active == 0 and orch.admission.waiting == 0

    _run(main(), timeout=60)


async def _check_shedding(orch: Orchestrator, url: str, grpc_port: int) -> None:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        running = asyncio.ensure_future(client.post("/v1/completions", json=body))
        while orch.admission.in_flight("prefill-0") < 1:
            await asyncio.sleep(0.005)
        queued = asyncio.ensure_future(client.post("/v1/completions", json=body))
        while orch.admission.waiting < 1:
            await asyncio.sleep(0.005)
        shed = await client.post("/v1/completions", json=body)
        assert shed.status_code == 429 and shed.headers["retry-after"] == "1"
        error = shed.json()["error"]
        assert error["type"] == "rate_limit_exceeded" and error["code"] == "queue_full"
        sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError) as info:
            await sdk.completions.create(model="tiny", prompt="Hi", max_tokens=3)
        assert info.value.response.headers["retry-after"] == "1"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = gateway_pb2_grpc.GenerateStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as rpc:
                await stub.Generate(gateway_pb2.GenerateRequest(text="Hi"))
        assert rpc.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        mesh = (await client.get("/mesh")).json()["queue"]
        assert mesh["queued"] == 1 and mesh["max_queued"] == 1 and mesh["shed"]["full"] == 3
        assert (await running).status_code == 200 and (await queued).status_code == 200
        metrics = (await client.get("/metrics")).text
        assert 'pdmesh_gateway_requests_shed_total{reason="full"} 3.0' in metrics
        assert "pdmesh_gateway_max_queued 1.0" in metrics
        # the queue drained: a new request is served again
        assert (await client.post("/v1/completions", json=body)).status_code == 200
