"""The Prefill gRPC service: pb → engine loop → pb. Domain errors become status codes in the interceptor.

Contract of Prefill: the target's layout must match this pool's (else FAILED_PRECONDITION); the prompt
runs first, then the hand-off is claimed by compare-and-set RESERVED → TRANSFERRING, and only then is
the ONE NIXL WRITE posted. A failed claim (the decode reservation expired or was cancelled meanwhile)
means no WRITE: the blocks are released and the answer is ABORTED. The answer comes only once the WRITE
is DONE and this rank's blocks are released; a failed transfer is UNAVAILABLE. This rank moves the
hand-off to CANCELLED only when no WRITE of its is in flight (none posted, or it ended): decode relies on
that to free its blocks at once (see `decode.core.may_be_written`).
"""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2
from pdmesh_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc

from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.scheduler import StepOutput
from pdmesh_service.errors import Aborted, FailedPrecondition, InvalidArgument, MeshError, NotFound, Unavailable
from pdmesh_service.logging import get_logger
from pdmesh_service.errors import require_id
from pdmesh_service.handoff import HandoffState
from pdmesh_prefill.core import PeerSet, PushTarget, check_prompt, check_target, prefill_params
from pdmesh_prefill.pusher import KVPusher, PushResult, TransferFailed
from pdmesh_service.worker.convert import first_token_of, sampling_from_pb, worker_status_pb
from pdmesh_service.worker.engine_loop import EngineLoop
from pdmesh_engine.transfer.layout import PoolLayout
from pdmesh_engine.transfer.pb import layout_from_pb

log = get_logger(__name__)
S = HandoffState


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine: EngineLoop, pusher: KVPusher, kvstore: Any, instance_id: str,
                 layout: PoolLayout) -> None:
        self.engine, self.pusher, self.kvstore = engine, pusher, kvstore
        self.instance_id, self.layout = instance_id, layout
        self.peers = PeerSet()
        self._connecting = asyncio.Lock()
        self._background: set[asyncio.Task] = set()

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        request_id, prompt = require_id(request.request_id), list(request.prompt_token_ids)
        params = prefill_params(sampling_from_pb(request.sampling))
        check_prompt(prompt, self.engine.vocab_size, self.engine.max_model_len)
        target = await self._target(request.target, len(prompt))
        await self._compute_and_claim(request_id, prompt, params)
        result = await self._push(request_id, target)
        return prefill_pb2.PrefillResponse(first_token=first_token_of(result.step),
                                           num_cached_tokens=result.step.num_cached_tokens,
                                           kv_bytes=result.kv_bytes, transfer_seconds=result.seconds)

    async def Status(self, request: decode_pb2.StatusRequest, context) -> decode_pb2.WorkerStatus:
        return worker_status_pb(self.instance_id, await self.engine.status(request.check_integrity))

    async def _compute_and_claim(self, request_id: str, prompt: list[int], params: SamplingParams) -> StepOutput:
        """Run the prompt, then claim the hand-off; on any failure release the blocks and cancel the
        hand-off (no WRITE was posted) before raising, so a retry under the same id cannot race it."""
        claiming = False
        try:
            step = await self.pusher.compute(prompt, params, request_id)
            claiming = True
            await self._claim(request_id)
            return step
        except BaseException as e:
            self.engine.abort_soon(request_id)
            if isinstance(e, Aborted):              # the claim failed: the record is not ours to change
                raise
            # a claim whose answer was lost may have applied: TRANSFERRING is then ours, and unwritten
            expected = (S.RESERVED, S.TRANSFERRING) if claiming else (S.RESERVED,)
            if isinstance(e, asyncio.CancelledError):
                self._spawn(self._cancel_handoff(request_id, expected))
            else:
                await self._cancel_handoff(request_id, expected)
            raise

    async def _claim(self, request_id: str) -> None:
        """RESERVED → TRANSFERRING by compare-and-set: from here on this rank, and only it, may write."""
        try:
            await self.kvstore.update_handoff(request_id, S.TRANSFERRING, self.instance_id, expected=S.RESERVED)
        except (FailedPrecondition, NotFound) as e:
            raise Aborted(f"the decode reservation of request {request_id} ended before the KV was ready "
                          f"({e})") from None
        except MeshError:
            raise
        except Exception as e:  # noqa: BLE001 - the kvstore is unreachable
            raise Unavailable(f"cannot claim the hand-off of {request_id} in the kvstore: {e}") from e

    async def _push(self, request_id: str, target: PushTarget) -> PushResult:
        """The WRITE, to its end (a cancelled caller leaves it running; it is never cut short)."""
        write = self.pusher.write(request_id, target)
        try:
            return await asyncio.shield(write)
        except TransferFailed:
            await self._after_failed_write(request_id, target)
            raise
        except asyncio.CancelledError:
            self._spawn(self._after_write(request_id, target, write))
            raise

    async def _after_write(self, request_id: str, target: PushTarget, write: asyncio.Future) -> None:
        try:
            await write
        except TransferFailed:
            await self._after_failed_write(request_id, target)
        except Exception:  # noqa: BLE001 - shutting down: the hand-off stays TRANSFERRING (decode quarantines)
            pass

    async def _after_failed_write(self, request_id: str, target: PushTarget) -> None:
        self.peers.discard(target.agent_name)                  # reload the peer's metadata next time
        self.kvstore.forget_agent(target.agent_name)
        await self._cancel_handoff(request_id, (S.TRANSFERRING,))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _target(self, pb: common_pb2.KVTarget, num_prompt_tokens: int) -> PushTarget:
        """The validated target, with its agent connected (metadata from the kvstore, once)."""
        if not pb.agent_name or not pb.HasField("layout"):
            raise InvalidArgument("target needs an agent_name and a layout")
        layout = layout_from_pb(pb.layout)          # ValueError (INVALID_ARGUMENT) when inconsistent
        layout.check_block_ids(pb.block_ids, "target block")
        try:
            self.layout.check_compatible(layout)
        except ValueError as e:
            raise FailedPrecondition(f"target pool of {pb.agent_name} does not match this pool: {e}") from e
        target = PushTarget(pb.agent_name, layout, tuple(pb.block_ids))
        check_target(num_prompt_tokens, self.layout.block_size, target)
        async with self._connecting:
            if pb.agent_name not in self.peers:
                metadata = await self.kvstore.get_agent(pb.agent_name)
                await self.engine.connect(pb.agent_name, metadata)
                self.peers.add(pb.agent_name)
        return target

    async def _cancel_handoff(self, request_id: str, expected: tuple[HandoffState, ...]) -> None:
        """CANCELLED from the first of `expected` the record is in; only when no WRITE of ours is in flight."""
        for state in expected:
            try:
                await self.kvstore.update_handoff(request_id, S.CANCELLED, self.instance_id, expected=state)
                return
            except FailedPrecondition:
                continue
            except Exception as e:  # noqa: BLE001 - bookkeeping only
                log.warning("hand-off update failed", request_id=request_id, state="CANCELLED", error=str(e))
                return
