"""The KVStore gRPC service: pb → `store` (over the pure `core`) → pb. Domain errors become status
codes in the interceptor (NotFound → NOT_FOUND, FailedPrecondition → FAILED_PRECONDITION,
InvalidArgument → INVALID_ARGUMENT). Every hand-off state reached is counted in
`pdmesh_kvstore_handoffs_total{state}` (once: a no-op move to the current state is not counted).

KV events go to the in-memory `prefix_index.PrefixIndex` (the server drops ranks that leave the
registry); each batch is counted in `pdmesh_kvstore_kv_event_batches_total{result}` (applied,
snapshot, resync)."""

from __future__ import annotations

from prometheus_client import Counter

from pdmesh_kvstore.prefix_index import PrefixIndex
from pdmesh_kvstore.store import KVStore
from pdmesh_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from pdmesh_service.handoff import Handoff, HandoffState, parse_state

HANDOFFS = Counter(
    "pdmesh_kvstore_handoffs_total", "KV hand-offs that reached each state", ["state"]
)

KV_EVENT_BATCHES = Counter(
    "pdmesh_kvstore_kv_event_batches_total",
    "KV event batches received: applied, snapshots taken, refused (resync asked)",
    ["result"],
)


def handoff_pb(handoff: Handoff) -> kvstore_pb2.Handoff:
    return kvstore_pb2.Handoff(**handoff.message_fields())


def _reached(handoff: Handoff) -> Handoff:
    HANDOFFS.labels(state=handoff.state.name).inc()
    return handoff


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: KVStore, index: PrefixIndex | None = None) -> None:
        self.store = store
        self.index = index if index is not None else PrefixIndex()

    async def RegisterAgent(
        self, request: kvstore_pb2.AgentInfo, context
    ) -> kvstore_pb2.RegisterAgentResponse:
        await self.store.put_agent(request.agent_name, request.metadata, request.instance_id)
        return kvstore_pb2.RegisterAgentResponse()

    async def GetAgent(
        self, request: kvstore_pb2.GetAgentRequest, context
    ) -> kvstore_pb2.AgentInfo:
        metadata, instance_id = await self.store.get_agent(request.agent_name)
        return kvstore_pb2.AgentInfo(
            agent_name=request.agent_name, metadata=metadata, instance_id=instance_id
        )

    async def OpenHandoff(
        self, request: kvstore_pb2.OpenHandoffRequest, context
    ) -> kvstore_pb2.Handoff:
        return handoff_pb(
            _reached(
                await self.store.open_handoff(
                    request.request_id,
                    request.decode_instance,
                    request.num_blocks,
                    request.lease_ms,
                )
            )
        )

    async def UpdateHandoff(
        self, request: kvstore_pb2.UpdateHandoffRequest, context
    ) -> kvstore_pb2.Handoff:
        state: HandoffState = parse_state(request.state)  # UNSPECIFIED → InvalidArgument
        expected = parse_state(request.expected_state) if request.expected_state else None
        handoff, changed = await self.store.transition(
            request.request_id, state, request.prefill_instance, expected
        )
        return handoff_pb(_reached(handoff) if changed else handoff)

    async def GetHandoff(
        self, request: kvstore_pb2.GetHandoffRequest, context
    ) -> kvstore_pb2.Handoff:
        return handoff_pb(await self.store.get_handoff(request.request_id))

    async def PublishKVEvents(
        self, request: kvstore_pb2.KVEvents, context
    ) -> kvstore_pb2.KVEventsAck:
        if request.snapshot:
            self.index.snapshot(request.rank_id, request.seq, request.stored)
            result = "snapshot"
        elif self.index.apply(request.rank_id, request.seq, request.stored, request.removed):
            result = "applied"
        else:
            result = "resync"
        KV_EVENT_BATCHES.labels(result=result).inc()
        return kvstore_pb2.KVEventsAck(resync=result == "resync")

    async def LongestPrefix(
        self, request: kvstore_pb2.LongestPrefixRequest, context
    ) -> kvstore_pb2.LongestPrefixResponse:
        matched = self.index.longest_prefix(request.block_hashes)
        return kvstore_pb2.LongestPrefixResponse(matched_blocks=matched)
