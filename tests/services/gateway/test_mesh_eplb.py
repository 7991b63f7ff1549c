"""GET /mesh/eplb: the gateway shows the EPLB state that eplb_protocol keeps in a real Redis."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer as HFTokenizer

from pdmesh.tools.tokenizer_train import tokenizer_config, train_tokenizer
from pdmesh_engine.tokenizer import Tokenizer
from pdmesh_gateway.core import ModelInfo
from pdmesh_gateway.metrics import GatewayMetrics
from pdmesh_gateway.orchestrator import Orchestrator
from pdmesh_gateway.rest import create_app, eplb_view
from pdmesh_gateway.router import Router
from pdmesh_service import eplb_protocol as proto
from pdmesh_service.eplb_protocol import LoadReport, Placement, RebalanceRecord
from pdmesh_service.redis_server import EmbeddedRedis
from pdmesh_service.registry import connect


def _report(rank: int, version: int, counts: list[int]) -> LoadReport:
    return LoadReport(
        "decode-a",
        "target",
        rank,
        2,
        step=900,
        window_steps=100,
        running_version=version,
        staged_version=1,
        slot_counts=[counts],
        num_logical=4,
    )


async def _mesh_eplb(
    redis_url: str, deployment: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cfg = tokenizer_config(512)
    tok = Tokenizer(
        HFTokenizer.from_str(train_tokenizer(512)),
        bos_token=cfg["bos_token"],
        eos_token=cfg["eos_token"],
        add_bos_token=True,
        chat_template=cfg["chat_template"],
    )
    redis = connect(redis_url)
    orch = Orchestrator(Router(), tok, metrics=GatewayMetrics(CollectorRegistry()))
    app = create_app(
        orch,
        tok,
        ModelInfo("tiny", "tiny-dir", 512, tok.vocab_size, created=1),
        CollectorRegistry(),
        eplb=eplb_view(redis, deployment),
    )
    try:
        # rank 0 switched to version 1 (slots on rank 0: 30 tokens, rank 1: 10); rank 1 is still on
        # 0
        await proto.publish_load(redis, deployment, _report(0, 1, [10, 20, 5, 5]))
        await proto.publish_load(redis, deployment, _report(1, 0, [50, 0, 0, 0]))
        await proto.publish_load(
            redis,
            deployment,
            LoadReport(
                "prefill-b",
                "draft",
                0,
                1,
                step=5,
                window_steps=5,
                running_version=0,
                staged_version=0,
                slot_counts=[[0, 0]],
                num_logical=2,
            ),
        )
        placement = Placement("decode-a", "target", 1, 2, [[0, 1, 2, 3]], 1000)
        record = RebalanceRecord(1, 1000, "manual", 2, 4096, 0.5, 0.9, 3.25)
        assert await proto.write_placement(redis, deployment, placement, 0, record)
        await proto.set_enabled(redis, deployment, "decode-a", False)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw"
        ) as client:
            eplb, mesh = (await client.get("/mesh/eplb")).json(), (await client.get("/mesh")).json()
        return eplb, mesh
    finally:
        await orch.close()
        await redis.aclose()


def test_mesh_eplb_shows_versions_balancedness_and_the_last_rebalance() -> None:
    with EmbeddedRedis() as server:
        eplb, mesh = asyncio.run(
            asyncio.wait_for(_mesh_eplb(server.url, f"gw-{uuid.uuid4().hex[:8]}"), 60)
        )
    assert mesh["instances"] == [] and mesh["eplb"] == eplb  # /mesh carries the same EPLB rows
    decode, prefill = eplb
    assert (decode["instance"], decode["model"], decode["version"]) == ("decode-a", "target", 1)
    assert decode["running_versions"] == {"0": 1, "1": 0} and decode["enabled"] is False
    assert decode["balancedness"] == 20 / 30  # rank 1's counts belong to version 0
    assert decode["last_rebalance"] == {
        "version": 1,
        "created_ms": 1000,
        "reason": "manual",
        "num_slots_moved": 2,
        "num_bytes_moved": 4096,
        "balancedness_before": 0.5,
        "balancedness_after": 0.9,
        "plan_ms": 3.25,
    }
    assert (prefill["instance"], prefill["model"], prefill["version"]) == ("prefill-b", "draft", 0)
    assert (
        prefill["balancedness"] == 1.0
        and prefill["last_rebalance"] is None
        and prefill["enabled"] is None
    )
