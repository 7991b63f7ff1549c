"""Protobuf ↔ engine conversions shared by the decode and prefill servicers.

Contracts: `sampling_from_pb` honours proto3 `optional` presence (an unset field takes the engine's
default) and raises ValueError (→ INVALID_ARGUMENT) for out-of-range values; `chunk_from_steps`
merges consecutive step outputs of one request into one `TokenChunk` (the last one decides the
finish reason).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2

from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.scheduler import StepOutput

if TYPE_CHECKING:
    from pdmesh_service.worker.engine_loop import EngineStatus

_OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "ignore_eos",
                    "min_tokens", "logprobs", "include_stop_str_in_output")
FINISH_REASONS = {None: common_pb2.FINISH_REASON_UNSPECIFIED, "stop": common_pb2.FINISH_REASON_STOP,
                  "length": common_pb2.FINISH_REASON_LENGTH, "abort": common_pb2.FINISH_REASON_ABORT}


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Engine sampling parameters from the wire form; unset optionals keep the engine defaults."""
    values: dict[str, object] = {name: getattr(pb, name) for name in _OPTIONAL_FIELDS if pb.HasField(name)}
    if pb.stop:
        values["stop"] = list(pb.stop)
    if pb.stop_token_ids:
        values["stop_token_ids"] = list(pb.stop_token_ids)
    return SamplingParams.from_dict(values)


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    """The wire form of engine parameters (every field set explicitly)."""
    pb = common_pb2.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        min_p=params.min_p, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, min_tokens=params.min_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output)
    if params.seed is not None:
        pb.seed = params.seed
    if params.logprobs is not None:
        pb.logprobs = params.logprobs
    return pb


def token_logprob(token_id: int, logprob: float | None = None,
                  top: Sequence[tuple[int, float]] = ()) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=token_id, logprob=logprob or 0.0,
        top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top])


def first_token_of(step: StepOutput) -> common_pb2.TokenLogprob:
    """The single sampled token of a prefill step (with its logprobs when they were asked for)."""
    if not step.new_token_ids:
        raise ValueError(f"request {step.request_id} produced no token")
    logprob = step.new_logprobs[0] if step.new_logprobs else None
    top = step.new_top_logprobs[0] if step.new_top_logprobs else ()
    return token_logprob(step.new_token_ids[0], logprob, top)


def chunk_from_steps(steps: Sequence[StepOutput]) -> decode_pb2.TokenChunk:
    """One `TokenChunk` carrying the tokens of `steps` (same request, in order)."""
    chunk = decode_pb2.TokenChunk()
    for step in steps:
        chunk.token_ids.extend(step.new_token_ids)
        if step.new_logprobs:
            chunk.logprobs.extend(token_logprob(t, lp, top) for t, lp, top in
                                  zip(step.new_token_ids, step.new_logprobs, step.new_top_logprobs))
    last = steps[-1]
    chunk.finish_reason = FINISH_REASONS[last.finish_reason]
    if isinstance(last.stop_reason, int) and not isinstance(last.stop_reason, bool):
        chunk.stop_token_id = last.stop_reason
    chunk.num_prompt_tokens = last.num_prompt_tokens
    chunk.num_cached_tokens = last.num_cached_tokens
    return chunk


def worker_status_pb(instance_id: str, status: EngineStatus) -> decode_pb2.WorkerStatus:
    stats = status.stats
    return decode_pb2.WorkerStatus(
        instance_id=instance_id, num_running=status.num_running, num_waiting=status.num_waiting,
        kv_blocks_used=status.kv_blocks_used, kv_blocks_free=status.kv_blocks_free,
        kv_blocks_total=status.kv_blocks_total, kv_bytes_sent=stats.kv_bytes_sent,
        kv_bytes_received=stats.kv_bytes_received, transfer_failures=stats.transfer_failures,
        lease_expiries=stats.lease_expiries, integrity_error=status.integrity_error,
        integrity_checked=status.integrity_checked, kv_quarantines=stats.kv_quarantines, rank=status.rank,
        dp_size=status.dp_size, expert_weight_bytes=status.expert_weight_bytes, requests_total=stats.requests_total)


def heartbeat_stats(status: EngineStatus) -> dict[str, int]:
    """The `InstanceInfo.stats` a worker publishes (the gateway routes on running + waiting)."""
    stats = status.stats
    return {"running": status.num_running, "waiting": status.num_waiting, "kv_blocks_used": status.kv_blocks_used,
            "kv_blocks_free": status.kv_blocks_free, "kv_bytes_sent": stats.kv_bytes_sent,
            "kv_bytes_received": stats.kv_bytes_received, "transfer_failures": stats.transfer_failures,
            "lease_expiries": stats.lease_expiries, "kv_quarantines": stats.kv_quarantines,
            "requests_total": stats.requests_total, "expert_weight_bytes": status.expert_weight_bytes}
