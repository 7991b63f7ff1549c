"""The gateway's autoscale loop over a real orchestrator (fake worker servicers over gRPC) and a
real Redis: a burst that queues at the prefill admission shows as queue time, the loop asks for one
more prefill replica, publishes it in Redis (what `pdmesh up` reads) and on the gauges (what KEDA
reads); before the burst it asks for nothing more. The flags parse into the config and agg mode
refuses a prefill pool."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from prometheus_client import CollectorRegistry
from test_gateway_core import FakeDecode, FakePrefill, _mesh, _run, _serve_fakes

from pdmesh_gateway.autoscale import DESIRED_REPLICAS_METRIC, QUEUE_TIME_METRIC, AutoscaleSettings
from pdmesh_gateway.autoscale_loop import AutoscaleConfig, AutoscaleLoop
from pdmesh_gateway.core import build_request, fold
from pdmesh_gateway.orchestrator import GatewayMetrics, Orchestrator
from pdmesh_gateway.server import add_arguments, config_from_args
from pdmesh_service.redis_client import connect
from pdmesh_service.redis_server import EmbeddedRedis
from pdmesh_service.scaling import PoolBounds, autoscale_key, read_desired

SETTINGS = AutoscaleSettings(window_s=5.0, target_queue_s=0.3, cooldown_s=60.0, up_stable_s=0.0)
BOUNDS = {"prefill": PoolBounds(1, 2), "decode": PoolBounds(1, 1)}


def test_a_burst_queued_at_the_gateway_asks_for_another_prefill_replica(tok, model) -> None:
    script = tok.encode("one two three four", add_special_tokens=False)

    async def main(redis_url: str) -> None:
        decode, prefill = FakeDecode(script), FakePrefill(script, delay=0.3)
        server, address = await _serve_fakes(decode, prefill)
        router = _mesh({"decode-0": address, "prefill-0": address})
        registry = CollectorRegistry()
        orch = Orchestrator(
            router,
            tok,
            metrics=GatewayMetrics(CollectorRegistry()),
            max_prefill_inflight=1,
            load_window_s=SETTINGS.window_s,
        )
        redis = connect(redis_url)
        loop = AutoscaleLoop(AutoscaleConfig(BOUNDS, SETTINGS), orch, router, redis, "t", registry)
        try:
            loop.tick(asyncio.get_running_loop().time())
            await loop.publish()
            assert {p: d.replicas for p, d in (await read_desired(redis, "t")).items()} == {
                "prefill": 1,
                "decode": 1,
            }

            async def one(i: int) -> str:
                req = build_request(f"r{i}", tok.encode("Hi"), {"max_tokens": 4}, model, "tiny")
                return fold([e async for e in orch.generate(req)]).finish_reason or ""

            burst = [asyncio.ensure_future(one(i)) for i in range(6)]
            await asyncio.sleep(1.0)  # one prefill slot, 0.3 s each: the others queue
            decisions = loop.tick(asyncio.get_running_loop().time())
            await loop.publish()
            assert decisions["prefill"].replicas == 2, decisions["prefill"].reason
            assert decisions["decode"].replicas == 1
            assert await asyncio.gather(*burst) == ["length"] * 6
            published = await read_desired(redis, "t")
            assert published["prefill"].replicas == 2
            assert "queue time" in published["prefill"].reason
            assert 0 < await redis.pttl(autoscale_key("t")) <= 10_000
            desired = registry.get_sample_value(DESIRED_REPLICAS_METRIC, {"pool": "prefill"})
            assert desired == 2
            assert registry.get_sample_value(QUEUE_TIME_METRIC) > SETTINGS.target_queue_s
            signals = orch.load_window.snapshot(asyncio.get_running_loop().time(), 1, 1)
            assert signals.arrival_rate > 0 and signals.mean_output_tokens == 4
            assert orch.load_window.num_queued == 0
        finally:
            await redis.aclose()
            await orch.close()
            await server.stop(None)

    with EmbeddedRedis() as redis_server:
        _run(main(redis_server.url))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", "m", *argv])


def test_gateway_flags_make_the_autoscale_config() -> None:
    args = _parse(["--autoscale", "prefill=1..3,decode=1..2", "--autoscale-cooldown-s", "12"])
    config = config_from_args(args)
    assert config.autoscale is not None
    assert str(config.autoscale) == "prefill=1..3,decode=1..2"
    assert config.autoscale.settings.cooldown_s == 12
    assert config_from_args(_parse([])).autoscale is None
    with pytest.raises(ValueError, match="agg mode has no prefill pool"):
        config_from_args(_parse(["--mode", "agg", "--autoscale", "prefill=1..2"]))
    assert config_from_args(_parse(["--mode", "agg", "--autoscale", "decode=1..2"])).autoscale
    with pytest.raises(SystemExit):
        _parse(["--autoscale", "prefill=2..1"])
