"""The gateway under overload, over fake decode/prefill workers on loopback gRPC: per-prefill-rank
admission (FCFS, at most N requests between Reserve and the end of Prefill, a client gone while
queued touches no worker), Reserve answering RESOURCE_EXHAUSTED waits and retries until the
request's timeout, and a lost hand-off before the first token is retried invisibly."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry
from test_gateway_core import (
    SCRIPT_TEXT,
    FakeDecode,
    FakePrefill,
    _mesh,
    _run,
    _serve_fakes,
)

from pdmesh_gateway.admission import PrefillAdmission
from pdmesh_gateway.core import build_request, fold
from pdmesh_gateway.orchestrator import GatewayMetrics, Orchestrator
from pdmesh_service.errors import ResourceExhausted
from pdmesh_service.grpc_server import ADMITTED_METADATA


class PoolDecode(FakeDecode):
    """A decode rank whose pool fits `capacity` reservations (RESOURCE_EXHAUSTED beyond), freed when
    the Decode stream ends; it announces admission; `lose` lists request ids whose first Decode is
    NOT_FOUND."""

    def __init__(self, script: list[int], capacity: int = 1000, lose: tuple[str, ...] = ()) -> None:
        super().__init__(script, delay=0.01)
        self.capacity, self.lose = capacity, set(lose)
        self.held: set[str] = set()
        # reserved, their Prefill not ended (see CountingPrefill)
        self.unprefilled: set[str] = set()
        self.exhausted = 0
        self.order: list[str] = []

    async def Reserve(self, request, context):
        if len(self.held) >= self.capacity:
            self.exhausted += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "not enough free KV blocks")
        self.held.add(request.request_id)
        self.unprefilled.add(request.request_id)
        self.order.append(request.request_id)
        return await super().Reserve(request, context)

    async def Decode(self, request, context):
        try:
            if request.request_id in self.lose:
                self.lose.discard(request.request_id)
                self.reserved.pop(request.request_id, None)
                await context.abort(
                    grpc.StatusCode.NOT_FOUND, f"no reservation for request {request.request_id!r}"
                )
            await context.send_initial_metadata(((ADMITTED_METADATA, "1"),))
            async for chunk in super().Decode(request, context):
                yield chunk
        finally:
            self.held.discard(request.request_id)

    async def Cancel(self, request, context):
        self.held.discard(request.request_id)
        self.reserved.pop(request.request_id, None)
        return await super().Cancel(request, context)


class CountingPrefill(FakePrefill):
    """Tracks how many requests are between their Reserve (on `decode`) and the end of their
    Prefill; `abort_first` lists request ids whose first Prefill is ABORTED (the reservation ended
    first)."""

    def __init__(
        self,
        script: list[int],
        decode: PoolDecode,
        delay: float = 0.05,
        abort_first: tuple[str, ...] = (),
    ) -> None:
        super().__init__(script, delay)
        self.decode, self.abort_first = decode, set(abort_first)
        self.most = 0
        self.seen: list[str] = []

    async def Prefill(self, request, context):
        self.most = max(self.most, self.outstanding())
        self.seen.append(request.request_id)
        try:
            if request.request_id in self.abort_first:
                self.abort_first.discard(request.request_id)
                await context.abort(
                    grpc.StatusCode.ABORTED, "the decode reservation ended before the KV was ready"
                )
            return await super().Prefill(request, context)
        finally:
            self.decode.unprefilled.discard(request.request_id)

    def outstanding(self) -> int:
        return len(self.decode.unprefilled)


async def _orchestrator(
    tok, decode: PoolDecode, prefill: FakePrefill, **kw: Any
) -> tuple[Orchestrator, grpc.aio.Server]:
    server, address = await _serve_fakes(decode, prefill)
    orch = Orchestrator(
        _mesh({"decode-0": address, "prefill-0": address}),
        tok,
        metrics=GatewayMetrics(CollectorRegistry()),
        **kw,
    )
    return orch, server


async def _complete(orch: Orchestrator, model, tok, request_id: str, max_tokens: int = 6):
    req = build_request(request_id, tok.encode("Hi"), {"max_tokens": max_tokens}, model, "tiny")
    return fold([e async for e in orch.generate(req)])


def test_admission_is_fcfs_per_rank_and_gives_back_cancelled_slots() -> None:
    async def main() -> None:
        gate = PrefillAdmission(limit=2)
        ranks = lambda: ["p0", "p1"]  # noqa: E731
        assert [await gate.acquire(ranks) for _ in range(4)] == ["p0", "p1", "p0", "p1"]
        waiters = [asyncio.ensure_future(gate.acquire(ranks)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert gate.waiting == 3 and not any(w.done() for w in waiters)
        waiters[0].cancel()  # leaves the queue; the next ones keep their order
        gate.release("p1")
        assert await waiters[1] == "p1" and not waiters[2].done() and gate.waiting == 1
        gate.release("p0")
        assert await waiters[2] == "p0" and gate.waiting == 0
        assert await gate.acquire(lambda: []) is None  # no usable rank: do without
        assert (gate.in_flight("p0"), gate.in_flight("p1")) == (2, 2)

    asyncio.run(asyncio.wait_for(main(), 10))


def test_at_most_n_requests_per_prefill_rank_between_reserve_and_prefill_end(tok, model) -> None:
    script = tok.encode(SCRIPT_TEXT, add_special_tokens=False)

    async def main() -> None:
        decode = PoolDecode(script)
        prefill = CountingPrefill(script, decode)
        orch, server = await _orchestrator(tok, decode, prefill, max_prefill_inflight=2)
        try:
            tasks = [asyncio.ensure_future(_complete(orch, model, tok, f"r{i}")) for i in range(8)]
            most_waiting = 0
            while not all(t.done() for t in tasks):
                most_waiting = max(most_waiting, orch.waiting)
                assert orch.admission.in_flight("prefill-0") <= 2 and prefill.outstanding() <= 2
                await asyncio.sleep(0.005)
            results = [t.result() for t in tasks]
        finally:
            await orch.close()
            await server.stop(None)
        assert all(r.token_ids == script[:6] and r.finish_reason == "length" for r in results)
        assert prefill.most == 2 and most_waiting >= 5
        # first come, first served (two at a time)
        assert sorted(decode.order) == [f"r{i}" for i in range(8)]
        assert all(abs(decode.order.index(f"r{i}") - i) <= 1 for i in range(8)), decode.order
        assert orch.waiting == 0 and orch.active == 0 and orch.admission.in_flight("prefill-0") == 0
        assert orch.metrics.waiting._value.get() == 0

    _run(main())


def test_reserve_short_of_blocks_waits_until_blocks_come_back(tok, model) -> None:
    script = tok.encode(SCRIPT_TEXT, add_special_tokens=False)

    async def main() -> None:
        decode = PoolDecode(script, capacity=1)
        orch, server = await _orchestrator(
            tok, decode, CountingPrefill(script, decode), max_prefill_inflight=4
        )
        try:
            results = await asyncio.gather(
                *(_complete(orch, model, tok, f"x{i}", 10) for i in range(4))
            )
        finally:
            await orch.close()
            await server.stop(None)
        assert all(r.token_ids == script[:10] for r in results)  # no 503 while the rank is ready
        assert decode.exhausted > 0 and sorted(decode.order) == [f"x{i}" for i in range(4)]

    _run(main())


def test_reserve_short_of_blocks_until_the_timeout_is_503(tok, model) -> None:
    script = tok.encode(SCRIPT_TEXT, add_special_tokens=False)

    async def main() -> None:
        decode = PoolDecode(script, capacity=0)
        orch, server = await _orchestrator(tok, decode, FakePrefill(script), request_timeout_s=0.5)
        try:
            with pytest.raises(ResourceExhausted) as info:
                await _complete(orch, model, tok, "never")
        finally:
            await orch.close()
            await server.stop(None)
        assert info.value.http_status == 503 and "timeout" in str(info.value)
        assert decode.exhausted >= 3 and orch.admission.in_flight("prefill-0") == 0

    _run(main())


def test_client_gone_while_queued_touches_no_worker(tok, model) -> None:
    script = tok.encode(SCRIPT_TEXT, add_special_tokens=False)

    async def main() -> None:
        decode = PoolDecode(script)
        prefill = FakePrefill(script, delay=0.3)
        orch, server = await _orchestrator(tok, decode, prefill, max_prefill_inflight=1)
        try:
            first = asyncio.ensure_future(_complete(orch, model, tok, "first"))
            queued = asyncio.ensure_future(_complete(orch, model, tok, "queued"))
            while orch.waiting < 1:
                await asyncio.sleep(0.005)
            queued.cancel()
            await asyncio.gather(queued, return_exceptions=True)
            assert orch.waiting == 0 and (await first).token_ids == script[:6]
            # the slot came back
            assert (await _complete(orch, model, tok, "after")).token_ids == script[:6]
        finally:
            await orch.close()
            await server.stop(None)
        assert decode.order == ["first", "after"] and prefill.calls == ["Prefill", "Prefill"]
        assert decode.cancelled == [] and orch.active == 0

    _run(main())


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_handoff_lost_before_the_first_token_is_retried_invisibly(tok, model, where: str) -> None:
    script = tok.encode(SCRIPT_TEXT, add_special_tokens=False)

    async def main() -> None:
        decode = PoolDecode(script, lose=("lost",) if where == "decode" else ())
        prefill = CountingPrefill(
            script, decode, abort_first=("lost",) if where == "prefill" else ()
        )
        orch, server = await _orchestrator(tok, decode, prefill)
        try:
            req = build_request("lost", tok.encode("Hi"), {"max_tokens": 6}, model, "tiny")
            events = [e async for e in orch.generate(req)]
        finally:
            await orch.close()
            await server.stop(None)
        assert fold(events).token_ids == script[:6] and events[0].token_ids == (script[0],)
        # one whole retry, under an id of its own
        assert decode.order == ["lost", "lost~1"] and prefill.seen == ["lost", "lost~1"]
        # the lost one answered at once
        assert decode.calls.count("Decode") == 1 and not decode.lose

    _run(main())
