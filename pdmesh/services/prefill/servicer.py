"""The Prefill gRPC service: pb → engine loop → pb. Domain errors become status codes in the interceptor.

Contract of Prefill: the target's layout must match this pool's (else FAILED_PRECONDITION); the
hand-off goes TRANSFERRING before the prompt runs; the answer comes only once the NIXL WRITE is DONE
and this rank's blocks are released. Any failure (or the caller going away) releases the blocks and
marks the hand-off CANCELLED; a failed transfer is UNAVAILABLE.
"""
from __future__ import annotations

import asyncio
from typing import Any

from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2
from pdmesh_proto.kvstore.v1 import kvstore_pb2
from pdmesh_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc

from pdmesh.services.common.errors import FailedPrecondition, InvalidArgument, MeshError, Unavailable
from pdmesh.services.common.logging import get_logger
from pdmesh.services.decode.servicer import require_id
from pdmesh.services.prefill.core import PeerSet, PushTarget, check_prompt, check_target, prefill_params
from pdmesh.services.prefill.pusher import KVPusher, PushResult
from pdmesh.services.worker.convert import first_token_of, sampling_from_pb, worker_status_pb
from pdmesh.services.worker.engine_loop import EngineLoop
from pdmesh.transfer.layout import PoolLayout
from pdmesh.transfer.pb import layout_from_pb

log = get_logger(__name__)


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
        await self._handoff(request_id, kvstore_pb2.HANDOFF_STATE_TRANSFERRING)
        result = await self._run(request_id, prompt, params, target)
        return prefill_pb2.PrefillResponse(first_token=first_token_of(result.step),
                                           num_cached_tokens=result.step.num_cached_tokens,
                                           kv_bytes=result.kv_bytes, transfer_seconds=result.seconds)

    async def Status(self, request: decode_pb2.StatusRequest, context) -> decode_pb2.WorkerStatus:
        return worker_status_pb(self.instance_id, await self.engine.status(request.check_integrity))

    async def _run(self, request_id: str, prompt: list[int], params, target: PushTarget) -> PushResult:
        try:
            return await self.pusher.prefill(prompt, params, request_id, target)
        except BaseException as e:
            self.engine.abort_soon(request_id)           # releases the blocks (after an in-flight WRITE)
            task = asyncio.ensure_future(self._cancel_handoff(request_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            if isinstance(e, Unavailable):                # reload the peer's metadata next time
                self.peers.discard(target.agent_name)
                self.kvstore.forget_agent(target.agent_name)
            raise

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

    async def _handoff(self, request_id: str, state: int) -> None:
        try:
            await self.kvstore.update_handoff(request_id, state, self.instance_id)
        except MeshError:
            raise                # e.g. FAILED_PRECONDITION: the reservation expired or was cancelled
        except Exception as e:  # noqa: BLE001 - the kvstore is unreachable
            raise Unavailable(f"cannot update the hand-off of {request_id} in the kvstore: {e}") from e

    async def _cancel_handoff(self, request_id: str) -> None:
        try:
            await self.kvstore.update_handoff(request_id, kvstore_pb2.HANDOFF_STATE_CANCELLED, self.instance_id)
        except Exception as e:  # noqa: BLE001 - bookkeeping only
            log.warning("hand-off update failed", request_id=request_id, state="CANCELLED", error=str(e))
