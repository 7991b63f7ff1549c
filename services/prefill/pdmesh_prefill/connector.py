"""The prefill connector: a prompt's KV from this rank's pool into a decode rank's reserved blocks.

Two halves, one per thread (like vLLM's scheduler-side and worker-side connector):
- `PrefillConnector` (event loop) drives a push through `core.PushState` — compute, claim the
  hand-off (RESERVED → TRANSFERRING, `kvstore_client.move_handoff`), WRITE — and ends it with
  what `core.END_ACTIONS` says it owes (abort the request, CANCEL the hand-off, forget the peer).
- `KVPusher` (engine thread, the loop's `EngineRole`) runs the prompt with `hold_blocks`, posts the
  ONE NIXL WRITE (notification = request id, with the digest of the bytes sent where `--kv-digest`
  asks: `pdmesh_engine.transfer.digest`), polls it until DONE or FAILED, and only then releases
  the blocks and answers (`PushResult`, or `TransferFailed`: none of its WRITEs is in flight). Its
  fault hook (`digest.CorruptKV`, tests and `bench chaos --corrupt-kv`) flips one byte in flight.

Block ownership: from `compute` until a WRITE is posted the engine holds the prompt's blocks for the
connector (an ending aborts the request to free them); once posted, the WRITE owns them until it
ends (an abort or a cancelled caller never cuts it short) and the pusher releases them itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.scheduler import StepOutput
from pdmesh_engine.transfer.digest import CorruptKV, DigestMode, is_digested
from pdmesh_prefill.core import (
    PushFlow,
    PushState,
    PushTarget,
    after_claim,
    claim_error,
)
from pdmesh_service.errors import FailedPrecondition, MeshError, Unavailable
from pdmesh_service.handoff import HandoffState, MoveOutcome, Unknown
from pdmesh_service.kvstore_client import KVStoreClient, RetryPolicy, move_handoff
from pdmesh_service.logging import get_logger
from pdmesh_service.tasks import Background
from pdmesh_service.worker.engine_loop import EngineLoop
from pdmesh_service.worker.stream import settle

if TYPE_CHECKING:
    from pdmesh_engine.transfer.agent import KVTransferAgent, Transfer

log = get_logger(__name__)


class TransferFailed(Unavailable):
    """The KV WRITE failed or could not be posted; no WRITE of this request is in flight."""


@dataclass(frozen=True)
class PushResult:
    """A WRITE that ended DONE; the engine released the prompt's blocks before this was sent."""

    step: StepOutput  # the finished prefill step: the first token
    kv_bytes: int  # every KV group's
    seconds: float  # from posting the WRITE to seeing it DONE
    draft_kv_bytes: int = 0  # of kv_bytes, the speculative proposer's (group `draft`)


# ----- engine thread -----
@dataclass(slots=True)
class _Push:
    """The engine thread's record of one push: computing (waiter = the compute future), computed
    (`step` set, blocks held), then writing (`transfer` set, waiter = the write future)."""

    request_id: str
    waiter: asyncio.Future[Any] | None  # the current phase's future, or None once answered
    step: StepOutput | None = None
    target: PushTarget | None = None
    transfer: Transfer | None = None
    started: float = 0.0
    num_bytes: int = 0  # every pool's
    num_draft_bytes: int = 0  # of num_bytes, the proposer pool's

    @property
    def is_in_flight(self) -> bool:
        return self.transfer is not None


class KVPusher:
    """The engine-thread half (the role hooks `PrefillConnector` hands on): all but `compute` and
    `write` run in the engine thread."""

    def __init__(
        self,
        loop: EngineLoop,
        agent: KVTransferAgent,
        digest: DigestMode = "off",
        corrupt: CorruptKV | None = None,
    ) -> None:
        """`digest`: which hand-offs carry a digest; `corrupt`: the fault hook (None: off)."""
        self.loop, self.agent = loop, agent
        self.digest, self.corrupt = digest, corrupt
        self._pushes: dict[str, _Push] = {}

    async def compute(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> StepOutput:
        """Run the prompt; its blocks stay held for `write` (or until an abort)."""
        step: StepOutput = await self.loop.submit(
            self._compute, list(prompt_ids), params, request_id, deferred=True
        )
        return step

    def write(self, request_id: str, target: PushTarget) -> asyncio.Future[PushResult]:
        """Post the computed prompt's WRITE; the future resolves once it ended and the blocks
        are released."""
        return self.loop.submit(self._write, request_id, target, deferred=True)

    def _compute(
        self,
        future: asyncio.Future[Any],
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
    ) -> None:
        self.loop.engine.add_request(prompt_ids, params, request_id, hold_blocks=True)
        self._pushes[request_id] = _Push(request_id, future)
        self.loop.metrics.request_taken()

    def _write(self, future: asyncio.Future[Any], request_id: str, target: PushTarget) -> None:
        push = self._pushes.get(request_id)
        if push is None or push.step is None or push.is_in_flight:
            raise FailedPrecondition(f"request {request_id} has no computed prompt to write")
        push.waiter, push.target, push.started = future, target, time.perf_counter()
        try:
            push.transfer = self.agent.write_handoff(
                request_id,
                self.loop.engine.kv_tables(request_id),
                target.agent_name,
                target.groups,
                {name: list(ids) for name, ids in target.block_ids.items()},
                push.step.num_prompt_tokens,
                digest=is_digested(self.digest, request_id),
                corrupt_at=self.corrupt.draw() if self.corrupt is not None else None,
            )
            # every KV group's blocks of the prompt that decode needs, every pool and layer
            push.num_bytes, push.num_draft_bytes = push.transfer.nbytes, push.transfer.draft_nbytes
        except Exception as e:  # noqa: BLE001 - nothing was posted: reported to the waiter
            self._end(push, e)

    def _answer(
        self,
        future: asyncio.Future[Any] | None,
        value: Any = None,
        error: BaseException | None = None,
    ) -> None:
        if future is not None:
            self.loop.post(settle, future, value, error)

    # ----- EngineRole -----
    def is_busy(self) -> bool:
        return any(p.is_in_flight for p in self._pushes.values())

    def take(self, output: StepOutput) -> bool:
        push = self._pushes.get(output.request_id)
        if push is None:
            return False
        if output.finish_reason is not None:
            push.step = output
            self._answer(push.waiter, output)
            push.waiter = None
        return True

    def poll(self) -> None:
        for push in [p for p in self._pushes.values() if p.transfer is not None]:
            try:
                state, error = self.agent.poll(push.transfer), None
            except Exception as e:  # noqa: BLE001 - a failed transfer, reported below
                state, error = "FAILED", e
            if state != "PENDING":
                failed = error or RuntimeError("NIXL reported the WRITE FAILED")
                self._end(push, None if state == "DONE" else failed)

    def _end(self, push: _Push, error: BaseException | None) -> None:
        """The WRITE ended (or was never posted): release the blocks, count, answer."""
        request_id, peer = push.request_id, push.target.agent_name if push.target else "?"
        del self._pushes[request_id]
        self.loop.engine.release_held(request_id)
        if error is None and push.step is not None:
            measured = push.transfer.seconds if push.transfer is not None else None
            seconds = measured if measured is not None else time.perf_counter() - push.started
            self.loop.metrics.kv_sent(push.num_bytes, seconds, push.num_draft_bytes)
            if push.transfer is not None and push.transfer.corrupted_address is not None:
                self.loop.metrics.kv_corruption_injected()
                log.warning("fault hook: KV sent with one byte flipped", request_id=request_id)
            self._answer(
                push.waiter,
                PushResult(push.step, push.num_bytes, seconds, push.num_draft_bytes),
            )
            return
        self.loop.metrics.transfer_failed()
        log.warning("KV transfer failed", request_id=request_id, peer=peer, error=str(error))
        self._answer(
            push.waiter,
            error=TransferFailed(f"KV transfer of request {request_id} to {peer} failed: {error}"),
        )

    def abort(self, request_id: str) -> tuple[bool, bool]:
        push = self._pushes.get(request_id)
        if push is None:
            return False, False
        if push.is_in_flight:  # ends by itself; its waiter learns how
            return True, True
        del self._pushes[request_id]
        self._answer(push.waiter, error=Unavailable(f"request {request_id} was aborted"))
        return True, False  # the engine frees (or releases the held) blocks

    def fail_all(self, error: BaseException) -> set[str]:
        for push in list(self._pushes.values()):
            self._answer(push.waiter, error=error)
            if not push.is_in_flight:
                del self._pushes[push.request_id]
        return set(self._pushes)


# ----- event loop -----
class PrefillConnector:
    """Pushes prompts' KV to decode ranks, keeping each hand-off record in the kvstore. It is the
    rank's role (`worker.runtime.WorkerRole`): its engine-thread hooks are its pusher's, and `close`
    ends what it runs in the background."""

    def __init__(
        self,
        loop: EngineLoop,
        pusher: KVPusher,
        kvstore: KVStoreClient,
        instance_id: str,
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        self.loop, self.pusher, self.kvstore = loop, pusher, kvstore
        self.instance_id, self.retry = instance_id, retry
        self._peers: set[str] = set()  # agents whose metadata the NIXL agent loaded
        self._connecting = asyncio.Lock()
        self._background = Background()

    async def push(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, target: PushTarget
    ) -> PushResult:
        """Prefill the prompt and write its KV into `target` once the hand-off is claimed.

        Aborted: the reservation ended first (no WRITE). Unavailable: the claim got no answer, or
        the engine stopped. TransferFailed: the WRITE failed (the hand-off is CANCELLED). A
        cancelled caller leaves a posted WRITE running; its end is still recorded."""
        await self._connect(target.agent_name)
        flow = PushFlow(request_id, target.agent_name)
        try:
            await self.pusher.compute(prompt_ids, params, request_id)
            flow.advance(PushState.CLAIMING)
            outcome = await move_handoff(
                self.kvstore,
                request_id,
                HandoffState.TRANSFERRING,
                (HandoffState.RESERVED,),
                self.instance_id,
                self.retry,
            )
        except BaseException as e:
            await self._settle_end(self._end(flow, PushState.CANCELLED), e)
            raise
        claimed = after_claim(outcome)
        if claimed is not PushState.CLAIMED:
            await self._end(flow, claimed)
            raise claim_error(request_id, outcome)
        flow.advance(PushState.CLAIMED)
        return await self._write(flow, target)

    async def _write(self, flow: PushFlow, target: PushTarget) -> PushResult:
        try:
            write = self.pusher.write(flow.request_id, target)
        except BaseException as e:
            await self._settle_end(self._end(flow, PushState.CANCELLED), e)
            raise
        flow.advance(PushState.WRITING)
        try:
            result = await asyncio.shield(write)
        except asyncio.CancelledError:
            self._background.spawn(self._outlive(flow, write))
            raise
        except TransferFailed:
            await self._end(flow, PushState.FAILED)
            raise
        # any other error: the engine stopped under the WRITE; the record stays TRANSFERRING and
        # decode keeps those blocks out of its pool until the cap (`handoff.may_be_written`)
        flow.advance(PushState.WRITTEN)
        return result

    async def _outlive(self, flow: PushFlow, write: asyncio.Future[PushResult]) -> None:
        """The caller left while its WRITE runs: record how the WRITE ends."""
        try:
            await write
        except TransferFailed:
            await self._end(flow, PushState.FAILED)
            return
        except MeshError:  # shutting down: the record stays TRANSFERRING (decode quarantines)
            return
        flow.advance(PushState.WRITTEN)

    def _end(self, flow: PushFlow, new: PushState) -> Coroutine[Any, Any, MoveOutcome | None]:
        """End the push in `new` (final): free what it owes now; the returned coroutine CANCELs the
        hand-off where the push may (await it, or spawn it when the caller is cancelled)."""
        action = flow.advance(new)
        if action is None:
            raise ValueError(f"{new.name} is not a final push state")
        if action.owns_blocks:
            self.loop.abort_soon(flow.request_id)
        if action.forget_peer:
            self._peers.discard(flow.peer)
            self.kvstore.forget_agent(flow.peer)
        return self._cancel_handoff(flow.request_id, action.cancel_from)

    async def _settle_end(
        self, cancel: Coroutine[Any, Any, MoveOutcome | None], error: BaseException
    ) -> None:
        """Await the hand-off's CANCEL before the caller hears of `error` (so a retry under the same
        id cannot race it), unless the caller is cancelled: then it runs in the background."""
        if isinstance(error, asyncio.CancelledError):
            self._background.spawn(cancel)
        else:
            await cancel

    async def _cancel_handoff(
        self, request_id: str, cancel_from: tuple[HandoffState, ...]
    ) -> MoveOutcome | None:
        if not cancel_from:
            return None
        outcome = await move_handoff(
            self.kvstore, request_id, HandoffState.CANCELLED, cancel_from, policy=self.retry
        )
        if isinstance(outcome, Unknown):
            log.warning("hand-off not cancelled", request_id=request_id, reason=outcome.reason)
        return outcome

    async def _connect(self, peer: str) -> None:
        """Load the peer agent's metadata from the kvstore once (again after a failed WRITE)."""
        async with self._connecting:
            if peer not in self._peers:
                metadata = await self.kvstore.get_agent(peer)
                await self.loop.connect(peer, metadata)
                self._peers.add(peer)

    async def close(self) -> None:
        """Cancel what runs in the background (hand-off updates, WRITEs outliving their caller)."""
        await self._background.close()

    # ----- EngineRole: the engine thread's half is the pusher -----
    def is_busy(self) -> bool:
        return self.pusher.is_busy()

    def poll(self) -> None:
        self.pusher.poll()

    def take(self, output: StepOutput) -> bool:
        return self.pusher.take(output)

    def abort(self, request_id: str) -> tuple[bool, bool]:
        return self.pusher.abort(request_id)

    def fail_all(self, error: BaseException) -> set[str]:
        return self.pusher.fail_all(error)
