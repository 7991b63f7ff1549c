"""The EPLB agent of a speculating rank reports and stages the draft model's experts as a model of
their own ("draft", beside "target"), against a real Redis and a real engine loop (tiny target,
tiny-draft draft model)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from pdmesh_engine import EngineConfig, EngineCore, SamplingParams
from pdmesh_service.eplb_protocol import Placement, read_loads, write_placement
from pdmesh_service.redis_server import EmbeddedRedis
from pdmesh_service.worker.engine_loop import EngineLoop
from pdmesh_service.worker.eplb_agent import EPLBAgentConfig, tick

DEPLOYMENT, INSTANCE = "test-eplb-draft", "decode-9"
MOVED = [3, 1, 2, 0]  # the draft's experts 0 and 3 trade slots


@pytest.fixture(scope="module")
def engine(spec_models: dict[str, Path]) -> EngineCore:
    target, draft = spec_models["tiny"], spec_models["draft"]
    config = EngineConfig(
        num_blocks=64,
        block_size=16,
        num_threads=1,
        speculative_method="draft_model",
        num_speculative_tokens=2,
        draft_model=str(draft),
    )
    engine = EngineCore(target, config)
    engine.add_request(list(range(4, 30)), SamplingParams(max_tokens=12, temperature=0.0))
    while engine.has_unfinished:
        engine.step()
    return engine


def test_draft_loads_are_published_and_its_placement_staged(engine: EngineCore) -> None:
    async def scenario(url: str) -> tuple:
        redis = aioredis.from_url(url)
        loop = EngineLoop(engine, instance_id=INSTANCE)
        loop.start()
        config = EPLBAgentConfig(DEPLOYMENT, INSTANCE, rank=0, dp_size=1)
        first = await tick(loop, redis, config)
        loads = {m: await read_loads(redis, DEPLOYMENT, INSTANCE, m) for m in first}
        placement = Placement(INSTANCE, "draft", 1, 1, [MOVED])
        assert await write_placement(redis, DEPLOYMENT, placement, 0)
        second = await tick(loop, redis, config)
        await loop.stop()
        await redis.aclose()
        return first, loads, second

    with EmbeddedRedis() as server:
        first, loads, second = asyncio.run(asyncio.wait_for(scenario(server.url), 60))
    assert sorted(first) == ["draft", "target"]
    assert all(result.reported and not result.staged for result in first.values())
    [draft], [target] = loads["draft"], loads["target"]
    assert (draft.num_layers, draft.num_slots, draft.num_logical) == (1, 4, 4)
    assert (target.num_layers, target.num_slots, target.num_logical) == (3, 8, 8)
    window = engine.expert_load_window("draft")
    assert draft.slot_counts == window[2] and sum(draft.slot_counts[0]) > 0
    assert draft.window_steps == window[0] == engine.expert_load_window()[0]
    # the draft's placement was staged (the target's untouched) and switches at the next step
    assert second["draft"].staged and not second["target"].staged
    stager = engine.expert_models["draft"].stager
    assert stager.wait(60) and stager.ready_version() == 1
    engine.step()
    assert stager.running_version == 1 and engine.placement_version == 0
    assert engine.expert_models["draft"].model.moe_layers[0].slot_experts == MOVED
    assert engine.expert_load_window("draft")[0] == 0  # its ring restarted, the target's did not
    assert engine.expert_load_window()[0] > 0
