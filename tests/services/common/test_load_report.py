"""A rank's heartbeat does not wait on a long engine step: it reports the last load after a short
wait, the fresh one once the engine answers, and `ready=False` once the engine thread has been
silent too long."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdmesh_service.instance import InstanceInfo, Role
from pdmesh_service.worker import runtime
from pdmesh_service.worker.engine_loop import EngineStatus
from pdmesh_service.worker.metrics import WorkerStats


class SlowEngine:
    """`status()` answers once `release` is set (an engine thread busy with a long step)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.running = 0
        self.calls = 0
        self.loads: list[object] = []
        self.metrics = SimpleNamespace(observe_load=self.loads.append)

    async def status(self) -> EngineStatus:
        self.calls += 1
        await self.release.wait()
        return EngineStatus(self.running, 0, 3, 5, 8, WorkerStats())


def test_a_beat_during_a_long_step_reports_the_last_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "STATUS_WAIT_S", 0.01)

    async def scenario() -> None:
        engine = SlowEngine()
        info = InstanceInfo("decode-0", Role.DECODE, "127.0.0.1:1", ready=True)
        report = runtime._LoadReport(engine, info)  # type: ignore[arg-type]
        first = await asyncio.wait_for(report(), 1.0)  # the engine is busy: no wait for it
        assert first == info and first.ready
        assert (await report()) == info and engine.calls == 1  # one status request at a time
        engine.running = 4
        engine.release.set()
        fresh = await report()
        assert fresh.stats.num_running == 4 and fresh.stats.num_kv_blocks_used == 3
        assert len(engine.loads) == 1
        engine.release.clear()
        monkeypatch.setattr(runtime, "ENGINE_SILENT_S", 0.0)  # the engine is now silent too long
        silent = await report()
        assert not silent.ready and silent.stats.num_running == 4
        engine.release.set()
        assert (await report()).ready  # it answered: routable again

    asyncio.run(scenario())
