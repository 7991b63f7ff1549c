"""Property tests of the pb ↔ Python conversions shared by the gateway and the workers.

- sampling: every valid `SamplingParams` survives gateway → wire → worker as the same settings
  (floats as the proto's float32 holds them, seeds as int64 holds them: the same torch seed);
- finish reasons: the tables are inverse, anything else is a ValueError;
- a decode step's outputs survive worker → `TokenChunk` → the gateway's `WorkerChunk`;
- `InstanceInfo` survives its JSON form, whatever unknown keys a newer release adds.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdmesh_engine import sampling
from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.scheduler import StepOutput
from pdmesh_gateway.core import GenerationRequest
from pdmesh_gateway.upstream import GATEWAY_ONLY_SAMPLING, chunk_of, sampling_pb
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_service.convert import (
    FINISH_REASON_OF,
    FINISH_REASON_PB,
    SAMPLING_PB_FIELDS,
    finish_reason_from_pb,
    finish_reason_to_pb,
    sampling_to_pb,
    token_logprob_pb,
)
from pdmesh_service.instance import InstanceInfo, Load, Role
from pdmesh_service.worker.convert import chunk_from_steps, first_token_of, sampling_from_pb

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None)
INT32 = st.integers(0, sampling.INT32_MAX)
UINT32 = st.integers(0, sampling.UINT32_MAX)
# text as it reaches a proto string field (valid Unicode: no lone surrogates)
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


def f32(value: float) -> float:
    """`value` as a proto `float` field holds it."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def wire_float(value: float) -> float:
    """`value` as the sender puts it in a float field: float32, a positive value kept positive."""
    return f32(value) if f32(value) or not value else 2.0**-149


@st.composite
def valid_params(draw: st.DrawFn) -> SamplingParams:
    """Any valid SamplingParams: each field drawn from its documented range."""
    max_tokens = draw(st.integers(1, sampling.UINT32_MAX))
    fields: dict[str, st.SearchStrategy[Any]] = {
        "max_tokens": st.just(max_tokens),
        "temperature": st.floats(0, sampling.MAX_TEMPERATURE),
        "top_k": st.integers(-1, sampling.INT32_MAX),
        "top_p": st.floats(0, 1, exclude_min=True),
        "min_p": st.floats(0, 1),
        "seed": st.none() | st.integers(sampling._SEED_MIN, sampling._SEED_MAX),
        "stop": st.lists(TEXT.filter(bool), max_size=4),
        "stop_token_ids": st.lists(INT32, max_size=4),
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(0, max_tokens),
        "logprobs": st.none() | st.integers(0, sampling.MAX_LOGPROBS),
        "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "prior_output_tokens": UINT32,
        # drawn together below: a kind with its text (the engine compiles it; here it only travels)
        "grammar_kind": st.none(),
        "grammar": st.none(),
        "cache_salt": st.none() | TEXT,
        "priority": st.integers(-(2**31), 2**31 - 1),
    }
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    unknown = set(names) - set(fields)
    assert not unknown, f"no strategy for the new sampling field(s) {unknown}"
    values = {n: draw(fields[n]) for n in names}
    kind = draw(st.none() | st.sampled_from(sampling.GRAMMAR_KINDS))
    if kind is not None:  # a grammar ends the output itself: no ignore_eos, no min_tokens
        text = None if kind == "json_object" else draw(TEXT.filter(bool))
        values |= {"grammar_kind": kind, "grammar": text, "ignore_eos": False, "min_tokens": 0}
    return SamplingParams(**values)


def _as_received(params: SamplingParams) -> SamplingParams:
    """What a worker should read from the wire form of `params`: float fields at float32, the seed
    wrapped into int64 (the same torch generator: manual_seed takes both), gateway-only fields at
    their defaults."""
    changes: dict[str, Any] = {
        f.name: f.default
        for f in dataclasses.fields(SamplingParams)
        if f.name not in SAMPLING_PB_FIELDS
    }
    for name in ("temperature", "top_p", "min_p"):
        changes[name] = wire_float(getattr(params, name))
    if params.seed is not None and params.seed >= 1 << 63:
        changes["seed"] = params.seed - (1 << 64)
    return dataclasses.replace(params, **changes)


@PROPERTY
@given(valid_params())
def test_sampling_params_survive_the_wire(params: SamplingParams) -> None:
    received = sampling_from_pb(sampling_to_pb(params))
    assert received == _as_received(params)


def test_a_top_p_below_float32_range_stays_positive_on_the_wire() -> None:
    """Regression: top_p 1e-50 is valid but rounds to 0 in float32, which the worker refuses."""
    received = sampling_from_pb(sampling_to_pb(SamplingParams(top_p=1e-50, temperature=1e-300)))
    assert 0 < received.top_p < 1e-44 and received.is_greedy


@PROPERTY
@given(valid_params())
def test_what_the_gateway_keeps_takes_the_workers_default(params: SamplingParams) -> None:
    """The gateway applies stop strings itself: the workers get the rest, and their defaults."""
    received = sampling_from_pb(sampling_pb(GenerationRequest("r", (1,), params, "m")))
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    kept = {name: defaults[name] for name in GATEWAY_ONLY_SAMPLING}
    assert received == dataclasses.replace(_as_received(params), **kept)


def test_finish_reasons_round_trip_and_cover_the_enum() -> None:
    assert set(FINISH_REASON_OF) == set(common_pb2.FinishReason.values())
    for reason, value in FINISH_REASON_PB.items():
        assert finish_reason_from_pb(finish_reason_to_pb(reason)) == reason
        assert finish_reason_to_pb(finish_reason_from_pb(value)) == value


@PROPERTY
@given(st.integers(), TEXT)
def test_unknown_finish_reasons_are_value_errors(value: int, reason: str) -> None:
    if value in FINISH_REASON_OF:
        assert finish_reason_from_pb(value) == FINISH_REASON_OF[value]
    else:
        with pytest.raises(ValueError, match="unknown finish reason"):
            finish_reason_from_pb(value)
    if reason in FINISH_REASON_PB:
        assert finish_reason_to_pb(reason) == FINISH_REASON_PB[reason]
    else:
        with pytest.raises(ValueError, match="unknown finish reason"):
            finish_reason_to_pb(reason)


LOGPROB = st.floats(allow_nan=False, width=32, max_value=0) | st.just(float("-inf"))
TOP = st.lists(st.tuples(INT32, LOGPROB), max_size=3)


@st.composite
def steps(draw: st.DrawFn) -> list[StepOutput]:
    """Consecutive outputs of one request; logprobs on every step or none; the last may finish."""
    with_logprobs = draw(st.booleans())
    out = []
    num_steps = draw(st.integers(1, 4))
    for i in range(num_steps):
        ids = draw(st.lists(INT32, min_size=1, max_size=3))
        last = i == num_steps - 1
        finish = draw(st.sampled_from(list(FINISH_REASON_PB))) if last else None
        stop = draw(st.none() | INT32 | TEXT) if finish == "stop" else None
        out.append(
            StepOutput(
                "req-1",
                ids,
                [draw(LOGPROB) for _ in ids] if with_logprobs else [],
                [draw(TOP) for _ in ids] if with_logprobs else [],
                finish,
                stop,
                draw(UINT32),
                draw(UINT32),
            )
        )
    return out


@PROPERTY
@given(steps())
def test_step_outputs_survive_token_chunk_to_the_gateway(outputs: list[StepOutput]) -> None:
    chunk = chunk_of(chunk_from_steps(outputs))
    last = outputs[-1]
    assert list(chunk.token_ids) == [t for s in outputs for t in s.new_token_ids]
    expected_logprobs = [
        (t, f32(lp), tuple((u, f32(v)) for u, v in top))
        for s in outputs
        if s.new_logprobs
        for t, lp, top in zip(s.new_token_ids, s.new_logprobs, s.new_top_logprobs, strict=True)
    ]
    assert [(lp.token_id, lp.logprob, lp.top) for lp in chunk.logprobs] == expected_logprobs
    assert chunk.finish_reason == last.finish_reason
    stop_id = last.stop_reason if isinstance(last.stop_reason, int) else 0
    assert chunk.stop_token_id == stop_id
    assert (chunk.num_prompt_tokens, chunk.num_cached_tokens) == (
        last.num_prompt_tokens,
        last.num_cached_tokens,
    )


@PROPERTY
@given(steps())
def test_the_first_token_of_a_prefill_step(outputs: list[StepOutput]) -> None:
    step = outputs[0]
    pb = first_token_of(step)
    assert pb.token_id == step.new_token_ids[0]
    assert pb.logprob == (f32(step.new_logprobs[0]) if step.new_logprobs else 0.0)
    top = step.new_top_logprobs[0] if step.new_top_logprobs else []
    assert [(t.token_id, t.logprob) for t in pb.top] == [(u, f32(v)) for u, v in top]
    assert token_logprob_pb(7).logprob == 0.0  # not computed: 0 on the wire


NON_NEGATIVE = st.integers(0, 2**53)
LOADS = st.builds(Load, **{f.name: NON_NEGATIVE for f in dataclasses.fields(Load)})
INSTANCES = st.builds(
    InstanceInfo,
    instance_id=TEXT,
    role=st.sampled_from(list(Role)),
    address=TEXT,
    rank=NON_NEGATIVE,
    dp_size=st.integers(1, 1024),
    model=TEXT,
    ready=st.booleans(),
    stats=LOADS,
    http_port=st.integers(0, 65535),
    updated_ms=NON_NEGATIVE,
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)


@PROPERTY
@given(
    INSTANCES, st.dictionaries(TEXT, JSON_VALUES, max_size=3), st.dictionaries(TEXT, NON_NEGATIVE)
)
def test_instance_info_survives_json_with_unknown_keys(info: InstanceInfo, extra, stats) -> None:
    assert InstanceInfo.from_json(info.to_json()) == info
    assert isinstance(InstanceInfo.from_json(info.to_json()).role, Role)
    values = json.loads(info.to_json())
    known = {f.name for f in dataclasses.fields(InstanceInfo)}
    values.update({k: v for k, v in extra.items() if k not in known})
    values["stats"].update({k: v for k, v in stats.items() if k not in values["stats"]})
    assert InstanceInfo.from_json(json.dumps(values)) == info
