"""Decode migration and the gateway's patience with dead, paused and missing ranks, over fake
workers on loopback gRPC: a request whose decode rank fails mid-stream goes on on another rank from
its tokens so far (prompt + those tokens, the budget left, the draws skipped), the client
sees every token once; a rank that leaves the registry is abandoned; no decode rank at all is waited
for a while before 503.

The fake "model" makes the continuation checkable: output token j of a request is SCRIPT[j] whatever
rank computes it, so a rank that continues after k tokens must be told k (`prior_output_tokens`) and
must find SCRIPT[:k] at the end of its prompt.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from pdmesh_gateway.core import GenerationRequest, build_request, fold
from pdmesh_gateway.migration import MigrationsExhausted, continuation, is_rank_loss
from pdmesh_gateway.orchestrator import GatewayMetrics, Orchestrator
from pdmesh_gateway.retry import Exclusions, RankGone
from pdmesh_gateway.router import NoInstance, Router
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2, decode_pb2_grpc
from pdmesh_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from pdmesh_service import errors
from pdmesh_service.registry import InstanceInfo

SCRIPT = [(7 * j + 3) % 400 + 20 for j in range(64)]  # output token j of any request


def _lp(t: int) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=t, logprob=-0.25)


class Decode(decode_pb2_grpc.DecodeServicer):
    """Streams SCRIPT from the request's position on; `fail_after` tokens into a stream it fails
    (UNAVAILABLE), or with `hang` stops answering (a paused process)."""

    def __init__(self, fail_after: int | None = None, hang: bool = False) -> None:
        self.fail_after, self.hang = fail_after, hang
        self.requests: list[Any] = []  # Reserve / Generate requests seen
        self.reserved: dict[str, Any] = {}

    async def Reserve(self, request, context):
        self.requests.append(request)
        self.reserved[request.request_id] = request
        return decode_pb2.ReserveResponse(target=common_pb2.KVTarget(instance_id="d"))

    async def Decode(self, request, context):
        async for chunk in self._stream(self.reserved.pop(request.request_id), 1):
            yield chunk

    async def Generate(self, request, context):
        self.requests.append(request)
        async for chunk in self._stream(request, 0):
            yield chunk

    async def _stream(self, request, start: int):
        prior = request.sampling.prior_output_tokens
        assert (
            list(request.prompt_token_ids[len(request.prompt_token_ids) - prior :])
            == (SCRIPT[:prior])
        )
        budget = request.sampling.max_tokens
        for j in range(start, budget):
            if self.fail_after is not None and j >= self.fail_after:
                if self.hang:
                    await asyncio.Event().wait()
                raise RuntimeError("rank died")  # the stream breaks: UNKNOWN status
            yield decode_pb2.TokenChunk(token_ids=[SCRIPT[prior + j]], logprobs=[_lp(0)])
        yield decode_pb2.TokenChunk(
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            num_prompt_tokens=len(request.prompt_token_ids),
        )

    async def Cancel(self, request, context):
        return decode_pb2.CancelResponse(found=True)


class Prefill(prefill_pb2_grpc.PrefillServicer):
    async def Prefill(self, request, context):
        prior = request.sampling.prior_output_tokens
        return prefill_pb2.PrefillResponse(first_token=_lp(SCRIPT[prior]))


async def _serve(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    if isinstance(servicer, Decode):
        decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    else:
        prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _view(addresses: dict[str, str], stamp: int = 0) -> list[InstanceInfo]:
    return [
        InstanceInfo(name, name.split("-")[0], address, ready=True, updated_ms=stamp)
        for name, address in addresses.items()
    ]


class Mesh:
    """Fake ranks on loopback and an orchestrator over them."""

    def __init__(self, **ranks) -> None:
        self.ranks = ranks
        self.servers: list[grpc.aio.Server] = []
        self.addresses: dict[str, str] = {}
        self.registry = CollectorRegistry()

    async def __aenter__(self) -> Mesh:
        for name, servicer in self.ranks.items():
            server, address = await _serve(servicer)
            self.servers.append(server)
            self.addresses[name.replace("_", "-")] = address
        return self

    def orchestrator(self, router: Router, **kw) -> Orchestrator:
        self.orch = Orchestrator(router, tok_of(), metrics=GatewayMetrics(self.registry), **kw)
        return self.orch

    def migrations(self) -> float:
        return self.registry.get_sample_value("pdmesh_gateway_migrations_total") or 0.0

    async def __aexit__(self, *exc: object) -> None:
        await self.orch.close()
        for server in self.servers:
            await server.stop(None)


_TOK: list[Any] = []


def tok_of() -> Any:
    return _TOK[0]


@pytest.fixture(autouse=True)
def _tokenizer(tok) -> None:
    _TOK[:] = [tok]


def _request(model, tok, max_tokens: int = 12, **values) -> GenerationRequest:
    values = {"max_tokens": max_tokens, "logprobs": 0, **values}
    return build_request("r1", tok.encode("Hi there"), values, model, "tiny")


def _run(coro, timeout: float = 30.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ----- pure parts -----


def test_continuation_carries_the_tokens_and_what_is_left_of_the_budget(tok, model) -> None:
    request = _request(model, tok, max_tokens=10, min_tokens=4, seed=5, temperature=0.7)
    first = continuation(request, SCRIPT[:3])
    assert first is not None
    assert first.prompt_ids == (*request.prompt_ids, *SCRIPT[:3])
    assert (first.params.max_tokens, first.params.min_tokens) == (7, 1)
    assert first.params.prior_output_tokens == 3 and first.params.seed == 5
    assert first.request_id == "r1~m1"  # not in the way of what the lost rank left behind
    second = continuation(request, SCRIPT[:9], 2)  # from the original, with all tokens so far
    assert second is not None and second.params.prior_output_tokens == 9
    assert second.request_id == "r1~m2" and second.prompt_ids == (*request.prompt_ids, *SCRIPT[:9])
    assert second.params.max_tokens == 1 and second.params.min_tokens == 0
    assert continuation(request, SCRIPT[:10]) is None  # nothing left to generate


@pytest.mark.parametrize(
    "error,migrates",
    [
        (errors.Unavailable("decode-0: connection reset"), True),
        (RankGone("decode-0", "not heartbeating"), True),
        (errors.MeshError("decode-0: internal"), True),
        (errors.DeadlineExceeded("the request timed out"), False),
        (errors.InvalidArgument("bad"), False),
        (MigrationsExhausted("too many"), False),
        (RuntimeError("a gateway bug"), False),
    ],
)
def test_only_rank_losses_migrate(error: BaseException, migrates: bool) -> None:
    assert is_rank_loss(error) is migrates


def test_an_excluded_rank_is_back_once_it_heartbeats_after_its_failure() -> None:
    excluded = Exclusions()
    excluded.add("decode-0", now_ms=1000)
    stale, fresh = _view({"decode-0": "a"}, 900)[0], _view({"decode-0": "a"}, 1500)[0]
    assert excluded.blocks(stale) and not excluded.blocks(fresh)
    assert excluded.blocked([stale, *_view({"decode-1": "b"}, 900)]) == {"decode-0"}


def test_a_rank_is_gone_only_after_missing_from_views_for_the_grace() -> None:
    router = Router(gone_after_s=0.2)
    router.update(_view({"decode-0": "a", "decode-1": "b"}))
    router.update(_view({"decode-1": "b"}))  # a late heartbeat, a Redis restart: not yet gone
    assert router.is_live("decode-0")
    time.sleep(0.25)
    assert router.is_live("decode-0"), "no new view (Redis down): nobody is declared gone"
    router.update(_view({"decode-1": "b"}))
    assert not router.is_live("decode-0") and router.is_live("decode-1")
    assert not router.is_live("decode-9")


# ----- over fake ranks -----


@pytest.mark.parametrize("mode", ["disagg", "agg"])
def test_a_decode_rank_failing_mid_stream_is_continued_on_another(tok, model, mode) -> None:
    async def main() -> None:
        dying, healthy = Decode(fail_after=4), Decode()
        async with Mesh(decode_0=dying, decode_1=healthy, prefill_0=Prefill()) as mesh:
            router = Router()
            router.update(_view(mesh.addresses))
            orch = mesh.orchestrator(router, mode=mode)
            request = _request(model, tok, max_tokens=12, seed=9, temperature=0.8)
            result = fold([e async for e in orch.generate(request)])
            assert result.token_ids == SCRIPT[:12], "every token once, in order"
            assert result.finish_reason == "length"
            assert result.usage.prompt_tokens == len(request.prompt_ids)
            assert result.usage.completion_tokens == 12 and len(result.logprobs) == 12
            assert mesh.migrations() == 1
            resumed = healthy.requests[-1]
            assert resumed.sampling.prior_output_tokens == 4
            assert resumed.sampling.max_tokens == 8 and resumed.sampling.seed == 9
            assert orch.active == 0

    _run(main())


def test_a_request_ends_with_an_error_after_max_migrations(tok, model) -> None:
    async def main() -> None:
        ranks = {f"decode_{i}": Decode(fail_after=2 * (i + 1)) for i in range(3)}
        async with Mesh(**ranks) as mesh:
            router = Router()
            router.update(_view(mesh.addresses))
            orch = mesh.orchestrator(router, mode="agg", max_migrations=1)
            seen: list[int] = []
            with pytest.raises(MigrationsExhausted, match="max-migrations 1"):
                async for event in orch.generate(_request(model, tok, max_tokens=30)):
                    seen += event.token_ids
            assert seen == SCRIPT[: len(seen)] and len(seen) >= 2, "no duplicate, no gap"
            assert mesh.migrations() == 1

    _run(main())


def test_a_rank_that_generated_everything_before_dying_ends_the_request(tok, model) -> None:
    async def main() -> None:
        async with Mesh(decode_0=Decode(fail_after=6)) as mesh:
            router = Router()
            router.update(_view(mesh.addresses))
            orch = mesh.orchestrator(router, mode="agg")
            result = fold([e async for e in orch.generate(_request(model, tok, max_tokens=6))])
            assert result.token_ids == SCRIPT[:6] and result.finish_reason == "length"
            assert result.usage.completion_tokens == 6

    _run(main())


def test_a_paused_rank_is_abandoned_once_it_leaves_the_registry(tok, model) -> None:
    async def main() -> None:
        paused, healthy = Decode(fail_after=3, hang=True), Decode()
        async with Mesh(decode_0=paused, decode_1=healthy) as mesh:
            router = Router(gone_after_s=0.3)
            router.update(_view(mesh.addresses))
            orch = mesh.orchestrator(router, mode="agg")

            async def registry() -> None:  # decode-0 stops heartbeating at once
                while True:
                    await asyncio.sleep(0.05)
                    router.update(_view({"decode-1": mesh.addresses["decode-1"]}))

            refresher = asyncio.ensure_future(registry())
            try:
                result = fold([e async for e in orch.generate(_request(model, tok))])
            finally:
                refresher.cancel()
            assert result.token_ids == SCRIPT[:12] and mesh.migrations() == 1

    _run(main())


def test_no_decode_rank_is_waited_for_then_503(tok, model) -> None:
    async def main() -> None:
        async with Mesh(decode_0=Decode()) as mesh:
            router = Router()
            orch = mesh.orchestrator(router, mode="agg", unroutable_wait_s=5.0)
            # a rank (re)appears while the request waits for one
            loop = asyncio.get_running_loop()
            loop.call_later(0.3, router.update, _view(mesh.addresses))
            result = fold([e async for e in orch.generate(_request(model, tok))])
            assert result.token_ids == SCRIPT[:12]
            assert mesh.registry.get_sample_value("pdmesh_gateway_retries_total") == 1
            impatient = Orchestrator(
                Router(),
                tok,
                metrics=GatewayMetrics(CollectorRegistry()),
                mode="agg",
                unroutable_wait_s=0.2,
            )
            with pytest.raises(NoInstance):
                async for _ in impatient.generate(_request(model, tok)):
                    pass
            await impatient.close()

    _run(main())


def test_health_tells_unavailable_degraded_and_ok() -> None:
    from pdmesh_gateway.router import health

    router = Router()
    assert health(router, needs_prefill=True)[0] == "unavailable"
    router.update(_view({"decode-0": "a", "kvstore-0": "k", "prefill-0": "p"}))
    assert health(router, needs_prefill=True) == (
        "ok",
        {"decode": 1, "prefill": 1, "kvstore": 1, "problems": []},
    )
    router.update(_view({"decode-0": "a"}))
    status, body = health(router, needs_prefill=True)
    assert status == "degraded" and len(body["problems"]) == 2  # no kvstore, no prefill
    assert health(router, needs_prefill=False)[0] == "ok"  # agg needs neither
    router.refresh_error = "ConnectionError: redis down"
    status, body = health(router, needs_prefill=False)
    assert status == "degraded" and "registry unreachable" in body["problems"][0]


class FlakyDecode(Decode):
    """Its first Reserve fails with `code` (UNAVAILABLE: after taking the id, as a rank whose
    kvstore or Redis is restarting does; RESOURCE_EXHAUSTED: short of blocks); later ones work."""

    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__()
        self.code, self.reserve_ids = code, []

    async def Reserve(self, request, context):
        self.reserve_ids.append(request.request_id)
        if len(self.reserve_ids) == 1:
            await context.abort(self.code, "first Reserve refused")
        return await super().Reserve(request, context)


def test_an_id_whose_reserve_failed_is_never_sent_to_any_rank_again(tok, model) -> None:
    """decode-0 fails Reserve and may have left a reservation or a live hand-off record under the
    id: neither it (back in play once it heartbeats) nor decode-1 is ever asked for that id again
    (the kvstore would refuse a second live hand-off of it); a rank short of blocks holds nothing,
    so it is asked again under the same id."""

    async def main() -> None:
        flaky = FlakyDecode(grpc.StatusCode.UNAVAILABLE)
        full = FlakyDecode(grpc.StatusCode.RESOURCE_EXHAUSTED)
        async with Mesh(decode_0=flaky, decode_1=full, prefill_0=Prefill()) as mesh:
            router = Router()
            orch = mesh.orchestrator(router)

            async def heartbeats() -> None:
                while True:
                    router.update(_view(mesh.addresses, int(time.time() * 1000)))
                    await asyncio.sleep(0.002)

            beating = asyncio.ensure_future(heartbeats())
            try:
                result = fold([e async for e in orch.generate(_request(model, tok))])
            finally:
                beating.cancel()
            assert result.token_ids == SCRIPT[:12]
            failed_id = flaky.reserve_ids[0]
            sent = flaky.reserve_ids + full.reserve_ids
            assert sent.count(failed_id) == 1, (flaky.reserve_ids, full.reserve_ids)

    _run(main())
