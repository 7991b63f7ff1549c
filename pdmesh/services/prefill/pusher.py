"""`KVPusher`: the prefill rank's part of the engine loop (runs in the engine thread).

A prefill request runs with `hold_blocks`; when its step finishes, its prompt blocks go to the
target in ONE NIXL WRITE (notification = request id), polled until DONE or FAILED, and only then
are the blocks released (also when the request was aborted meanwhile: NIXL may still read them).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pdmesh.engine.sampling import SamplingParams
from pdmesh.engine.scheduler import StepOutput
from pdmesh.services.common.errors import Unavailable
from pdmesh.services.common.logging import get_logger
from pdmesh.services.prefill.core import Push, PushTarget, kv_bytes, plan_push
from pdmesh.services.worker.engine_loop import (KV_TRANSFER_BYTES, KV_TRANSFER_FAILURES, KV_TRANSFER_SECONDS,
                                                EngineLoop)

log = get_logger(__name__)


@dataclass(frozen=True)
class PushResult:
    step: StepOutput        # the finished prefill step: the first token
    kv_bytes: int
    seconds: float          # from posting the WRITE to seeing it DONE


class KVPusher:
    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self._pushes: dict[str, Push] = {}
        loop.role = self

    async def prefill(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                      target: PushTarget) -> PushResult:
        """Run the prompt, write its KV into the target blocks, release ours; Unavailable on failure."""
        return await self.loop.submit(self._prefill, list(prompt_ids), params, request_id, target, deferred=True)

    # ----- engine thread -----
    def _prefill(self, future: asyncio.Future, prompt_ids: list[int], params: SamplingParams,
                 request_id: str, target: PushTarget) -> None:
        self.loop.engine.add_request(prompt_ids, params, request_id, hold_blocks=True)
        self._pushes[request_id] = Push(request_id, target, future)

    def is_busy(self) -> bool:
        return bool(self._pushes)

    def take(self, output: StepOutput) -> bool:
        push = self._pushes.get(output.request_id)
        if push is None:
            return False
        if output.finish_reason is not None:
            self._start(push, output)
        return True

    def _start(self, push: Push, step: StepOutput) -> None:
        layout, agent = self.loop.agent.layout, self.loop.agent
        push.step, push.started = step, time.perf_counter()
        try:
            local, remote = plan_push(step.num_prompt_tokens, layout.block_size,
                                      self.loop.engine.blocks_of(push.request_id), push.target)
            push.num_bytes = kv_bytes(len(local), layout.num_layers, layout.block_bytes)
            push.transfer = agent.write(push.request_id, local, push.target.agent_name, push.target.layout, remote)
        except Exception as e:  # noqa: BLE001 - reported to the waiter
            self._end(push, e)

    def poll(self) -> None:
        for push in [p for p in self._pushes.values() if p.in_flight]:
            try:
                state, error = self.loop.agent.poll(push.transfer), None
            except Exception as e:  # noqa: BLE001 - a failed transfer, reported below
                state, error = "FAILED", e
            if state != "PENDING":
                self._end(push, None if state == "DONE" else error or RuntimeError("NIXL reported the WRITE FAILED"))

    def _end(self, push: Push, error: BaseException | None) -> None:
        request_id, loop, labels = push.request_id, self.loop, {"instance": self.loop.instance_id}
        del self._pushes[request_id]
        loop.engine.release_held(request_id)
        if error is None:
            seconds = getattr(push.transfer, "seconds", None) or time.perf_counter() - push.started
            loop.stats.kv_bytes_sent += push.num_bytes
            KV_TRANSFER_BYTES.labels(**labels).inc(push.num_bytes)
            KV_TRANSFER_SECONDS.labels(**labels).observe(seconds)
            loop.resolve(push.waiter, PushResult(push.step, push.num_bytes, seconds))
            return
        loop.stats.transfer_failures += 1
        KV_TRANSFER_FAILURES.labels(**labels).inc()
        log.warning("KV transfer failed", request_id=request_id, peer=push.target.agent_name, error=str(error))
        loop.resolve(push.waiter, error=Unavailable(
            f"KV transfer of request {request_id} to {push.target.agent_name} failed: {error}"))

    def abort(self, request_id: str) -> tuple[bool, bool]:
        push = self._pushes.get(request_id)
        if push is None:
            return False, False
        self.loop.resolve(push.waiter, error=Unavailable(f"request {request_id} was aborted"))
        if push.in_flight:
            push.aborted = True
            return True, True
        del self._pushes[request_id]
        return True, False

    def fail_all(self, error: BaseException) -> set[str]:
        for push in list(self._pushes.values()):
            self.loop.resolve(push.waiter, error=error)
            push.aborted = True
            if not push.in_flight:
                del self._pushes[push.request_id]
        return set(self._pushes)
