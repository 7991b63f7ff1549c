"""Protobuf ↔ engine conversions shared by the decode and prefill servicers.

Contracts: `sampling_from_pb` honours proto3 `optional` presence (an unset field takes the engine's
default) and raises ValueError (→ INVALID_ARGUMENT) for out-of-range values; `chunk_from_steps`
merges consecutive step outputs of one request into one `TokenChunk` (the last one decides the
finish reason). The field and enum tables come from `pdmesh_service.convert` (read off the protos).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.scheduler import StepOutput
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2
from pdmesh_service.convert import finish_reason_to_pb, sampling_values_from_pb, token_logprob_pb
from pdmesh_service.instance import Load

if TYPE_CHECKING:
    from pdmesh_service.worker.engine_loop import EngineStatus


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Engine sampling parameters from the wire form; unset optionals keep the engine defaults."""
    return SamplingParams.from_dict(sampling_values_from_pb(pb))


def first_token_of(step: StepOutput) -> common_pb2.TokenLogprob:
    """The single sampled token of a prefill step (with its logprobs when they were asked for)."""
    if not step.new_token_ids:
        raise ValueError(f"request {step.request_id} produced no token")
    logprob = step.new_logprobs[0] if step.new_logprobs else None
    top = step.new_top_logprobs[0] if step.new_top_logprobs else ()
    return token_logprob_pb(step.new_token_ids[0], logprob, top)


def chunk_from_steps(steps: Sequence[StepOutput]) -> decode_pb2.TokenChunk:
    """One `TokenChunk` carrying the tokens of `steps` (same request, in order)."""
    chunk = decode_pb2.TokenChunk()
    for step in steps:
        chunk.token_ids.extend(step.new_token_ids)
        if step.new_logprobs:
            chunk.logprobs.extend(
                token_logprob_pb(t, lp, top)
                for t, lp, top in zip(
                    step.new_token_ids, step.new_logprobs, step.new_top_logprobs, strict=True
                )
            )
    last = steps[-1]
    chunk.finish_reason = finish_reason_to_pb(last.finish_reason)
    if isinstance(last.stop_reason, int) and not isinstance(last.stop_reason, bool):
        chunk.stop_token_id = last.stop_reason
    chunk.num_prompt_tokens = last.num_prompt_tokens
    chunk.num_cached_tokens = last.num_cached_tokens
    return chunk


def worker_status_pb(instance_id: str, status: EngineStatus) -> common_pb2.WorkerStatus:
    stats = status.stats
    return common_pb2.WorkerStatus(
        instance_id=instance_id,
        num_running=status.num_running,
        num_waiting=status.num_waiting,
        kv_blocks_used=status.kv_blocks_used,
        kv_blocks_free=status.kv_blocks_free,
        kv_blocks_total=status.kv_blocks_total,
        kv_bytes_sent=stats.kv_bytes_sent,
        kv_bytes_received=stats.kv_bytes_received,
        transfer_failures=stats.transfer_failures,
        lease_expiries=stats.lease_expiries,
        integrity_error=status.integrity_error,
        integrity_checked=status.integrity_checked,
        kv_quarantines=stats.kv_quarantines,
        rank=status.rank,
        dp_size=status.dp_size,
        expert_weight_bytes=status.expert_weight_bytes,
        requests_total=stats.requests_total,
        kv_digest_mismatches=stats.kv_digest_mismatches,
        kv_corruptions_injected=stats.kv_corruptions_injected,
    )


def heartbeat_stats(status: EngineStatus) -> Load:
    """The `InstanceInfo.stats` a worker publishes (the gateway routes on num_running +
    num_waiting)."""
    stats = status.stats
    return Load(
        num_running=status.num_running,
        num_waiting=status.num_waiting,
        num_kv_blocks_used=status.kv_blocks_used,
        num_kv_blocks_free=status.kv_blocks_free,
        num_kv_bytes_sent=stats.kv_bytes_sent,
        num_kv_bytes_received=stats.kv_bytes_received,
        num_transfer_failures=stats.transfer_failures,
        num_lease_expiries=stats.lease_expiries,
        num_kv_quarantines=stats.kv_quarantines,
        num_requests=stats.requests_total,
        num_expert_weight_bytes=status.expert_weight_bytes,
    )
