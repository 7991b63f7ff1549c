"""The EPLB contract in a real Redis: codecs, key names, the version compare-and-set, history, the
switch."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from pdmesh_service import eplb_protocol as proto
from pdmesh_service.eplb_protocol import LoadReport, Placement, RebalanceRecord
from pdmesh_service.redis_server import EmbeddedRedis
from pdmesh_service.registry import connect, namespace


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as server:
        yield server.url


def _run(redis_url: str, body: Callable[[Any, str], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        redis = connect(redis_url)
        try:
            return await body(redis, f"eplb-{uuid.uuid4().hex[:8]}")
        finally:
            await redis.aclose()

    return asyncio.run(asyncio.wait_for(main(), 30))


def _report(
    rank: int = 0, instance: str = "decode-1", model: str = "target", **kw: Any
) -> LoadReport:
    fields: dict[str, Any] = dict(
        dp_size=2,
        step=50,
        window_steps=40,
        running_version=0,
        staged_version=0,
        slot_counts=[[1, 2, 3, 4, 5, 6]],
        num_logical=4,
    )
    fields.update(kw)
    return LoadReport(instance, model, rank, **fields)


def _placement(version: int, instance: str = "decode-1", model: str = "target") -> Placement:
    return Placement(
        instance, model, version, 2, [[0, 1, 2, 3, version % 4, (version + 1) % 4]], 123
    )


def _record(version: int) -> RebalanceRecord:
    return RebalanceRecord(version, 1000 + version, "interval", 2, 2048, 0.5, 0.9, 1.5)


def test_records_round_trip_through_json() -> None:
    report = _report(expert_bytes=1024, num_nodes=2, switch_step=10)
    assert LoadReport.from_json(report.to_json()) == report
    newer = report.to_json()[:-1] + ',"field_of_a_newer_release":1}'
    assert LoadReport.from_json(newer) == report  # unknown keys are ignored
    assert report.num_layers == 1 and report.num_slots == 6 and report.steps_since_switch == 40
    assert Placement.from_json(_placement(3).to_json()) == _placement(3)
    assert RebalanceRecord.from_json(_record(2).to_json()) == _record(2)


@pytest.mark.parametrize(
    "bad",
    [
        dict(rank=2),
        dict(slot_counts=[[1, 2, 3], [1, 2]]),
        dict(slot_counts=[]),
        dict(num_logical=7),
        dict(dp_size=4),
        dict(step=5, switch_step=6),
        dict(window_steps=-1),
        dict(instance="a:b"),
    ],
)
def test_load_report_rejects_what_the_controller_cannot_use(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        _report(**bad)


def test_record_reason_and_placement_shape_are_checked() -> None:
    with pytest.raises(ValueError):
        RebalanceRecord(1, 0, "cron", 0, 0, 0.5, 0.5, 0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Placement("decode-1", "target", 1, 4, [[0, 1, 2, 3, 0, 1]])  # 6 slots over 4 ranks
    identity = proto.identity_placement("decode-1", "draft", 2, 2, 6, 4)
    assert identity.version == 0 and identity.physical_to_logical == [[0, 1, 2, 3, 0, 1]] * 2


def test_keys_live_under_the_deployment_namespace() -> None:
    assert (
        proto.load_key("dep", "decode-1", "draft", 3)
        == f"{namespace('dep')}:eplb:load:decode-1:draft:3"
    )
    assert proto.placement_key("dep", "p", "target").startswith(
        f"{namespace('dep')}:eplb:placement:"
    )
    assert proto.history_key("dep", "p", "target").startswith(f"{namespace('dep')}:eplb:history:")


def test_reports_are_read_per_instance_and_model_and_expire(redis_url: str) -> None:
    async def body(redis: Any, deployment: str) -> None:
        await proto.publish_load(redis, deployment, _report(1))
        await proto.publish_load(redis, deployment, _report(0))
        await proto.publish_load(
            redis, deployment, _report(0, model="draft", slot_counts=[[1, 1]], num_logical=2)
        )
        await proto.publish_load(redis, deployment, _report(0, instance="prefill-1"), ttl_s=0.2)
        # malformed
        await redis.set(proto.load_key(deployment, "decode-1", "target", 5), b'{"rank": 5}')
        assert [
            r.rank for r in await proto.read_loads(redis, deployment, "decode-1", "target")
        ] == [0, 1]
        assert [
            r.model for r in await proto.read_loads(redis, deployment, "decode-1", "draft")
        ] == ["draft"]
        assert await proto.tracked(redis, deployment) == [
            ("decode-1", "draft"),
            ("decode-1", "target"),
            ("prefill-1", "target"),
        ]
        await asyncio.sleep(0.4)
        assert ("prefill-1", "target") not in await proto.tracked(redis, deployment)
        assert await proto.tracked(redis, "other-deployment") == []

    _run(redis_url, body)


def test_versions_advance_only_by_compare_and_set(redis_url: str) -> None:
    async def body(redis: Any, deployment: str) -> None:
        # version 0
        assert await proto.read_placement(redis, deployment, "decode-1", "target") is None
        assert await proto.write_placement(redis, deployment, _placement(1), 0, _record(1))
        # lost race
        assert not await proto.write_placement(redis, deployment, _placement(1), 0, _record(1))
        assert not await proto.write_placement(redis, deployment, _placement(3), 2)  # not current
        with pytest.raises(ValueError):
            await proto.write_placement(redis, deployment, _placement(3), 1)  # a skip
        assert await proto.write_placement(redis, deployment, _placement(2), 1, _record(2))
        current = await proto.read_placement(redis, deployment, "decode-1", "target")
        assert current == _placement(2)
        assert await proto.read_placement(
            redis, deployment, "decode-1", "target", version=1
        ) == _placement(1)
        assert (
            await proto.read_placement(redis, deployment, "decode-1", "target", version=7) is None
        )
        assert [
            r.version for r in await proto.read_history(redis, deployment, "decode-1", "target")
        ] == [2, 1]
        # per model
        assert await proto.read_placement(redis, deployment, "decode-1", "draft") is None

    _run(redis_url, body)


def test_two_writers_racing_from_one_version_publish_exactly_one(redis_url: str) -> None:
    async def body(redis: Any, deployment: str) -> list[bool]:
        other = connect(redis_url)
        try:
            a = Placement("decode-1", "target", 1, 2, [[0, 1, 2, 3, 0, 1]])
            b = Placement("decode-1", "target", 1, 2, [[0, 1, 2, 3, 2, 3]])
            won = await asyncio.gather(
                proto.write_placement(redis, deployment, a, 0, _record(1)),
                proto.write_placement(other, deployment, b, 0, _record(1)),
            )
            current = await proto.read_placement(redis, deployment, "decode-1", "target")
            assert current == (a if won[0] else b)
            assert len(await proto.read_history(redis, deployment, "decode-1", "target")) == 1
            return won
        finally:
            await other.aclose()

    assert sorted(_run(redis_url, body)) == [False, True]


def test_history_is_newest_first_and_trimmed(redis_url: str) -> None:
    async def body(redis: Any, deployment: str) -> None:
        for version in range(1, proto.HISTORY_LIMIT + 6):
            await proto.append_history(redis, deployment, "decode-1", "target", _record(version))
        history = await proto.read_history(redis, deployment, "decode-1", "target")
        assert len(history) == proto.HISTORY_LIMIT
        assert history[0].version == proto.HISTORY_LIMIT + 5 and history[-1].version == 6
        assert [
            r.version for r in await proto.read_history(redis, deployment, "decode-1", "target", 2)
        ] == [proto.HISTORY_LIMIT + 5, proto.HISTORY_LIMIT + 4]

    _run(redis_url, body)


def test_off_switch_is_per_instance_with_a_default(redis_url: str) -> None:
    async def body(redis: Any, deployment: str) -> None:
        assert await proto.is_enabled(redis, deployment, "decode-1") is True
        assert await proto.is_enabled(redis, deployment, "decode-1", default=False) is False
        await proto.set_enabled(redis, deployment, "decode-1", False)
        assert await proto.is_enabled(redis, deployment, "decode-1") is False
        assert await proto.is_enabled(redis, deployment, "prefill-1") is True
        await proto.set_enabled(redis, deployment, "decode-1", True)
        assert await proto.is_enabled(redis, deployment, "decode-1", default=False) is True

    _run(redis_url, body)
