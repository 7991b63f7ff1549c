"""`KVPusher`: the prefill rank's part of the engine loop (runs in the engine thread).

Two phases, so that the hand-off can be claimed in between (see `prefill.servicer`):
- `compute`: the prompt runs with `hold_blocks`; the future gets its finished step (the first token)
  and the blocks stay held;
- `write`: the prompt blocks go to the target in ONE NIXL WRITE (notification = request id), polled
  until DONE or FAILED; only then are the blocks released and the future resolved (PushResult, or
  `TransferFailed`: the WRITE did not happen or ended failed, none of ours is in flight any more).
An abort frees the blocks of a push not yet written (the compute future fails); a WRITE in flight is
never cut short: NIXL reads the blocks until it ends.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.scheduler import StepOutput
from pdmesh_service.errors import FailedPrecondition, Unavailable
from pdmesh_service.logging import get_logger
from pdmesh_prefill.core import Push, PushTarget, kv_bytes, plan_push
from pdmesh_service.worker.engine_loop import (KV_TRANSFER_BYTES, KV_TRANSFER_FAILURES, KV_TRANSFER_SECONDS,
                                                EngineLoop)

log = get_logger(__name__)


class TransferFailed(Unavailable):
    """The KV WRITE failed or could not be posted; no WRITE of this request is in flight."""


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

    async def compute(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> StepOutput:
        """Run the prompt; its blocks stay held for `write` (or until an abort)."""
        return await self.loop.submit(self._compute, list(prompt_ids), params, request_id, deferred=True)

    def write(self, request_id: str, target: PushTarget) -> asyncio.Future:
        """Post the computed prompt's WRITE; the future resolves once it ended and the blocks are released."""
        return self.loop.submit(self._write, request_id, target, deferred=True)

    # ----- engine thread -----
    def _compute(self, future: asyncio.Future, prompt_ids: list[int], params: SamplingParams,
                 request_id: str) -> None:
        self.loop.engine.add_request(prompt_ids, params, request_id, hold_blocks=True)
        self._pushes[request_id] = Push(request_id, future)
        self.loop.stats.requests_total += 1

    def is_busy(self) -> bool:
        return any(p.in_flight for p in self._pushes.values())

    def take(self, output: StepOutput) -> bool:
        push = self._pushes.get(output.request_id)
        if push is None:
            return False
        if output.finish_reason is not None:
            push.step = output
            self.loop.resolve(push.waiter, output)
            push.waiter = None
        return True

    def _write(self, future: asyncio.Future, request_id: str, target: PushTarget) -> None:
        push = self._pushes.get(request_id)
        if push is None or not push.computed or push.in_flight:
            raise FailedPrecondition(f"request {request_id} has no computed prompt waiting to be written")
        layout, agent = self.loop.agent.layout, self.loop.agent
        push.waiter, push.target, push.started = future, target, time.perf_counter()
        try:
            local, remote = plan_push(push.step.num_prompt_tokens, layout.block_size,
                                      self.loop.engine.blocks_of(request_id), target)
            push.num_bytes = kv_bytes(len(local), layout.num_layers, layout.block_bytes)
            push.transfer = agent.write(request_id, local, target.agent_name, target.layout, remote)
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
        loop.resolve(push.waiter, error=TransferFailed(
            f"KV transfer of request {request_id} to {push.target.agent_name} failed: {error}"))

    def abort(self, request_id: str) -> tuple[bool, bool]:
        push = self._pushes.get(request_id)
        if push is None:
            return False, False
        if push.in_flight:                # ends by itself; its waiter learns how
            return True, True
        del self._pushes[request_id]
        self.loop.resolve(push.waiter, error=Unavailable(f"request {request_id} was aborted"))
        return True, False                # the engine frees (or releases the held) blocks

    def fail_all(self, error: BaseException) -> set[str]:
        for push in list(self._pushes.values()):
            self.loop.resolve(push.waiter, error=error)
            if not push.in_flight:
                del self._pushes[push.request_id]
        return set(self._pushes)
