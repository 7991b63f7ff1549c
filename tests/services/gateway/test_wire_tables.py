"""The tables read off the protos (finish reasons, sampling fields, logprobs) and the typed registry
record."""

from __future__ import annotations

from dataclasses import fields

import pytest

from pdmesh_engine.sampling import SamplingParams
from pdmesh_gateway.core import SAMPLING_FIELDS, WorkerChunk
from pdmesh_gateway.openai_api import error_body
from pdmesh_gateway.servicer import to_request
from pdmesh_gateway.upstream import GATEWAY_ONLY_SAMPLING, chunk_of, sampling_pb
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2
from pdmesh_proto.gateway.v1 import gateway_pb2
from pdmesh_service.convert import (
    FINISH_REASON_OF,
    SAMPLING_PB_FIELDS,
    finish_reason_from_pb,
    finish_reason_names,
    finish_reason_to_pb,
    sampling_to_pb,
    sampling_values_from_pb,
    token_logprob_pb,
)
from pdmesh_service.errors import InvalidArgument, NotFound
from pdmesh_service.instance import InstanceInfo, Load, Role

NOT_ON_THE_WIRE = {"skip_special_tokens"}  # detokenization happens at the gateway only


# ----- finish reasons ----------------------------------------------------------------------------


def test_every_finish_reason_value_maps_both_ways() -> None:
    values = dict(common_pb2.FinishReason.items())
    assert set(FINISH_REASON_OF) == set(values.values())
    assert FINISH_REASON_OF[common_pb2.FINISH_REASON_UNSPECIFIED] is None
    assert {FINISH_REASON_OF[v] for v in values.values()} - {None} == {"stop", "length", "abort"}
    for number in values.values():
        assert finish_reason_to_pb(finish_reason_from_pb(number)) == number


def test_unknown_finish_reasons_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown finish reason"):
        finish_reason_to_pb("timeout")
    with pytest.raises(ValueError, match="unknown finish reason"):
        finish_reason_from_pb(99)
    with pytest.raises(ValueError, match="prefix"):
        finish_reason_names([("FINISH_REASON_UNSPECIFIED", 0), ("DONE", 1)])


def test_a_new_enum_value_gets_its_name_without_another_table() -> None:
    assert finish_reason_names(
        [("FINISH_REASON_UNSPECIFIED", 0), ("FINISH_REASON_TOOL_CALL", 4)]
    ) == {0: None, 4: "tool_call"}


# ----- sampling ----------------------------------------------------------------------------------


def test_every_sampling_field_has_a_proto_field_and_back() -> None:
    engine = {f.name for f in fields(SamplingParams)}
    assert set(SAMPLING_FIELDS) == engine
    assert engine - set(SAMPLING_PB_FIELDS) == NOT_ON_THE_WIRE
    assert set(SAMPLING_PB_FIELDS) <= engine  # every wire field is an engine field
    assert GATEWAY_ONLY_SAMPLING <= set(SAMPLING_PB_FIELDS)


def test_sampling_round_trips_through_the_wire() -> None:
    # floats exact in float32 (the wire type)
    params = SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_k=3,
        top_p=0.75,
        min_p=0.125,
        seed=2**64 - 1,
        stop=("x", "yz"),
        stop_token_ids=(4, 5),
        ignore_eos=False,  # set, at its default: present on the wire all the same
        min_tokens=0,
        logprobs=3,
        include_stop_str_in_output=True,
        grammar_kind="regex",
        grammar="a+",
        cache_salt="tenant",
        priority=-3,
    )
    pb = sampling_to_pb(params)
    assert pb.seed == -1  # uint64 seeds wrap into the int64 field
    values = sampling_values_from_pb(pb)
    assert set(values) == set(SAMPLING_PB_FIELDS)
    back = SamplingParams.from_dict({**values, "seed": params.seed})
    assert back == params


def test_unset_sampling_fields_stay_unset() -> None:
    pb = sampling_to_pb(SamplingParams(max_tokens=5))  # seed and logprobs None: unset
    assert not pb.HasField("seed") and not pb.HasField("logprobs") and pb.HasField("max_tokens")
    assert sampling_values_from_pb(common_pb2.SamplingParams(top_k=2)) == {"top_k": 2}


def test_workers_get_no_stop_strings(tok, model) -> None:  # noqa: F811 - fixtures
    message = gateway_pb2.GenerateRequest(
        text="Hi",
        sampling=common_pb2.SamplingParams(
            max_tokens=4, stop=["zz"], include_stop_str_in_output=True, seed=9
        ),
    )
    request = to_request(message, tok, model)
    assert request.params.stop == ("zz",) and request.params.include_stop_str_in_output
    pb = sampling_pb(request)
    assert list(pb.stop) == [] and not pb.HasField("include_stop_str_in_output")
    assert pb.max_tokens == 4 and pb.seed == 9


def test_a_grpc_grammar_is_compiled_before_routing(tok, model) -> None:  # noqa: F811 - fixtures
    def request(kind: str, grammar: str):
        sampling = common_pb2.SamplingParams(max_tokens=4, grammar_kind=kind, grammar=grammar)
        return to_request(gateway_pb2.GenerateRequest(text="Hi", sampling=sampling), tok, model)

    assert request("regex", "[a-z]+").params.grammar == "[a-z]+"
    with pytest.raises(InvalidArgument, match="regex grammar does not compile") as e:
        request("regex", "a(")
    assert e.value.param == "grammar"


# ----- token logprobs and chunks -----------------------------------------------------------------


def test_one_logprob_builder_and_its_reader() -> None:
    pb = token_logprob_pb(7, -0.25, [(7, -0.25), (3, -2.0)])
    assert (pb.token_id, pb.logprob, [(t.token_id, t.logprob) for t in pb.top]) == (
        7,
        -0.25,
        [(7, -0.25), (3, -2.0)],
    )
    assert token_logprob_pb(1).logprob == 0.0
    chunk = chunk_of(
        decode_pb2.TokenChunk(
            token_ids=[7],
            logprobs=[pb],
            finish_reason=common_pb2.FINISH_REASON_STOP,
            stop_token_id=7,
            num_prompt_tokens=3,
        )
    )
    assert chunk == WorkerChunk((7,), (chunk.logprobs[0],), "stop", 7, 3, 0)
    assert chunk.logprobs[0].top == ((7, -0.25), (3, -2.0))


# ----- errors ------------------------------------------------------------------------------------


def test_error_fields_are_constructor_fields() -> None:
    error = NotFound("no such model", param="model", code="model_not_found")
    assert error_body(error) == {
        "error": {
            "message": "no such model",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    plain = InvalidArgument("bad")
    assert (plain.param, plain.code, str(plain)) == (None, None, "bad") and isinstance(
        plain, ValueError
    )


# ----- the registry record -----------------------------------------------------------------------


def test_instance_info_is_typed_and_round_trips() -> None:
    info = InstanceInfo(
        "decode-1", "decode", "127.0.0.1:1", ready=True, stats=Load(num_running=2, num_waiting=1)
    )
    assert info.role is Role.DECODE and info.role == "decode"
    back = InstanceInfo.from_json(info.to_json())
    assert back == info and back.stats.num_running == 2
    assert '"role": "decode"' in info.to_json()


def test_instance_info_reads_a_newer_record_and_rejects_unknown_roles() -> None:
    newer = (
        '{"instance_id": "p-1", "role": "prefill", "address": "a:1", "ready": true, "zone": "b",'
        ' "stats": {"num_running": 4, "num_gpus": 8}}'
    )
    info = InstanceInfo.from_json(newer)
    assert info.role is Role.PREFILL and info.stats == Load(num_running=4)
    with pytest.raises(ValueError, match="role must be one of"):
        InstanceInfo("x", "router", "a:1")
    with pytest.raises(ValueError, match="stats must be a Load"):
        InstanceInfo("x", "decode", "a:1", stats={"running": 1})  # type: ignore[arg-type]


def test_the_gateway_mode_is_an_enum_checked_once() -> None:
    from pathlib import Path

    from pdmesh_gateway.orchestrator import Mode
    from pdmesh_gateway.server import GatewayConfig

    assert GatewayConfig(model_dir=Path("m"), mode="agg").mode is Mode.AGG  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--mode must be one of"):
        GatewayConfig(model_dir=Path("m"), mode="both")  # type: ignore[arg-type]
