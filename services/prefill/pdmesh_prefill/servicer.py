"""The Prefill gRPC service: pb → `connector.PrefillConnector` → pb. Domain errors become status
codes in the interceptor (see `connector.PrefillConnector.push` for which and when).

Contract of Prefill: the target's revision must be this rank's, its KV groups this rank's, and its
speculative setting this rank's (else FAILED_PRECONDITION: see `core.check_revision`,
`core.check_target`, `core.check_speculation`; a revision refusal is counted in
`pdmesh_handoff_revision_refusals_total` and logged);
the prompt runs first, then the hand-off is claimed (RESERVED → TRANSFERRING), and only then is
the ONE NIXL WRITE posted. A claim that finds the reservation ended means no WRITE: the blocks are
released and the answer is ABORTED. The answer comes only once the WRITE is DONE and this rank's
blocks are released; a failed transfer is UNAVAILABLE. This rank moves the hand-off to CANCELLED
only when no WRITE of its is in flight (none posted, or it ended): decode relies on that to free
its blocks at once (`pdmesh_service.handoff.may_be_written`).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter

from pdmesh_engine.sampling import check_prompt
from pdmesh_engine.transfer.layout import KVGroup
from pdmesh_engine.transfer.pb import group_from_pb
from pdmesh_prefill.connector import PrefillConnector
from pdmesh_prefill.core import (
    PushTarget,
    RevisionMismatch,
    check_revision,
    check_speculation,
    check_target,
    prefill_params,
)
from pdmesh_prefill.metrics import revision_refusals
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from pdmesh_service.errors import InvalidArgument, require_id
from pdmesh_service.logging import get_logger
from pdmesh_service.revision import Revision
from pdmesh_service.worker.convert import first_token_of, sampling_from_pb, worker_status_pb
from pdmesh_service.worker.engine_loop import EngineLoop

log = get_logger(__name__)


def target_from_pb(pb: common_pb2.KVTarget) -> PushTarget:
    """The wire target; InvalidArgument (or ValueError) when incomplete or inconsistent."""
    if not pb.agent_name or not pb.groups:
        raise InvalidArgument("target needs an agent_name and its KV groups")
    groups = [group_from_pb(g) for g in pb.groups]
    return PushTarget(
        pb.agent_name,
        tuple(g for g, _ in groups),
        {g.name: ids for g, ids in groups},
        pb.speculative,
        pb.revision,
        dict(pb.revision_parts),
    )


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(
        self,
        connector: PrefillConnector,
        engine: EngineLoop,
        instance_id: str,
        groups: tuple[KVGroup, ...],
        speculative: str = "",
        revision: Revision = Revision(),
        refusals: Counter | None = None,
    ) -> None:
        """`groups`: this rank's KV groups; `speculative`: its proposer setting ("": off);
        `revision`: its revision; `refusals`: counts the targets refused for their revision
        (default: this rank's child of `revision_refusals()`)."""
        self.connector, self.engine = connector, engine
        self.instance_id, self.groups, self.speculative = instance_id, groups, speculative
        self.revision = revision
        self.refusals = refusals or revision_refusals().labels(instance_id)

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: Any
    ) -> prefill_pb2.PrefillResponse:
        request_id, prompt = require_id(request.request_id), list(request.prompt_token_ids)
        params = prefill_params(sampling_from_pb(request.sampling))
        check_prompt(
            prompt, vocab_size=self.engine.vocab_size, max_model_len=self.engine.max_model_len
        )
        target = target_from_pb(request.target)
        self._check_revision(request_id, target)
        check_speculation(target, self.speculative)
        check_target(target, self.groups, len(prompt))
        result = await self.connector.push(request_id, prompt, params, target)
        return prefill_pb2.PrefillResponse(
            first_token=first_token_of(result.step),
            kv_bytes=result.kv_bytes,
            draft_kv_bytes=result.draft_kv_bytes,
            num_cached_tokens=result.step.num_cached_tokens,
            transfer_seconds=result.seconds,
        )

    def _check_revision(self, request_id: str, target: PushTarget) -> None:
        try:
            check_revision(target, self.revision)
        except RevisionMismatch as e:
            self.refusals.inc()
            log.warning("cross-revision hand-off refused", request_id=request_id, reason=str(e))
            raise

    async def Status(
        self, request: common_pb2.StatusRequest, context: Any
    ) -> common_pb2.WorkerStatus:
        return worker_status_pb(self.instance_id, await self.engine.status(request.check_integrity))
