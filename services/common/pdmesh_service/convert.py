"""Protobuf ↔ Python conversions shared by the gateway and the workers (no torch, no engine import).

The tables are read off the proto descriptors of `pdmesh.common.v1`, so a value or field added there
reaches every service without another copy:
- finish reasons: enum value `FINISH_REASON_<X>` ↔ "<x>" ("stop", "length", "abort"); the zero value
  (`FINISH_REASON_UNSPECIFIED`, "not finished") ↔ None.
- sampling: each field of the `SamplingParams` message has the name of the engine's `SamplingParams`
  field it carries, except the gateway-only `skip_special_tokens` (detokenization never leaves the
  gateway). proto3 `optional` presence means "set by the caller"; an unset field takes the engine's
  default.
- token logprobs: `token_logprob_pb` is the one builder of `TokenLogprob` messages.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

from google.protobuf.descriptor import FieldDescriptor

from pdmesh_proto.common.v1 import common_pb2

# the engine is not a dependency of every service; only its field names are used here
if TYPE_CHECKING:
    from pdmesh_engine.sampling import SamplingParams

FINISH_REASON_PREFIX = "FINISH_REASON_"
_INT64_WRAP = 1 << 64
_FLOAT32_LEAST = 2.0**-149  # the least positive float32 (subnormal)


def finish_reason_names(values: Sequence[tuple[str, int]]) -> dict[int, str | None]:
    """Wire value → reason ("stop", ...) for the (name, number) pairs of a FinishReason-style enum;
    0 → None."""
    table: dict[int, str | None] = {}
    for name, number in values:
        if not name.startswith(FINISH_REASON_PREFIX):
            raise ValueError(
                f"finish reason enum value {name} lacks the prefix {FINISH_REASON_PREFIX}"
            )
        table[number] = None if number == 0 else name[len(FINISH_REASON_PREFIX) :].lower()
    return table


# Wire value → "stop" | "length" | "abort" | None, and back.
FINISH_REASON_OF: Mapping[int, str | None] = MappingProxyType(
    finish_reason_names(common_pb2.FinishReason.items())
)
FINISH_REASON_PB: Mapping[str | None, int] = MappingProxyType(
    {v: k for k, v in FINISH_REASON_OF.items()}
)


def finish_reason_from_pb(value: int) -> str | None:
    """The reason a wire value stands for (None: not finished); ValueError for a value this build
    lacks."""
    try:
        return FINISH_REASON_OF[value]
    except KeyError:
        raise ValueError(f"unknown finish reason {value}") from None


def finish_reason_to_pb(reason: str | None) -> common_pb2.FinishReason:
    """The wire value of a reason (None: FINISH_REASON_UNSPECIFIED); ValueError for an unknown
    reason. The generated stubs type the enum as a subclass of int, while its values are plain ints:
    the cast only retypes."""
    try:
        return cast(common_pb2.FinishReason, FINISH_REASON_PB[reason])
    except KeyError:
        raise ValueError(
            f"unknown finish reason {reason!r}; known: {sorted(filter(None, FINISH_REASON_PB))}"
        ) from None


# ----- sampling ---------------------------------------------------------------------------------

SAMPLING_PB_FIELDS: tuple[str, ...] = tuple(
    f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields
)


def sampling_values_from_pb(pb: common_pb2.SamplingParams) -> dict[str, Any]:
    """The fields the caller set, by name: `optional` ones when present, repeated ones when
    non-empty (as lists). Feed to `SamplingParams.from_dict`, which validates them."""
    values: dict[str, Any] = {}
    for field in pb.DESCRIPTOR.fields:
        if field.is_repeated:
            items = getattr(pb, field.name)
            if items:
                values[field.name] = list(items)
        elif field.has_presence and pb.HasField(field.name):
            values[field.name] = getattr(pb, field.name)
    return values


def _wire_scalar(field: FieldDescriptor, value: Any) -> Any:
    """int64 fields take uint64 values two's-complement wrapped (seeds up to 2**64 - 1); a positive
    value of a float field stays positive (top_p=1e-50 would round to float32 0, which the receiver
    refuses; the least float32 keeps the same single token)."""
    if field.type == FieldDescriptor.TYPE_FLOAT and isinstance(value, float):
        return _FLOAT32_LEAST if 0 < value < _FLOAT32_LEAST else value
    if (
        field.type
        in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64)
        and isinstance(value, int)
        and value >= 1 << 63
    ):
        return value - _INT64_WRAP
    return value


def sampling_to_pb(
    params: SamplingParams, exclude: Collection[str] = ()
) -> common_pb2.SamplingParams:
    """The wire form of engine parameters: every proto field but `exclude` from the attribute of the
    same name; a None attribute stays unset (the receiver's default)."""
    pb = common_pb2.SamplingParams()
    for field in pb.DESCRIPTOR.fields:
        if field.name in exclude:
            continue
        value = getattr(params, field.name)
        if value is None:
            continue
        if field.is_repeated:
            getattr(pb, field.name).extend(value)
        else:
            setattr(pb, field.name, _wire_scalar(field, value))
    return pb


# ----- token logprobs ----------------------------------------------------------------------------


def token_logprob_pb(
    token_id: int, logprob: float | None = None, top: Sequence[tuple[int, float]] = ()
) -> common_pb2.TokenLogprob:
    """A chosen token with its logprob (None: not computed, sent as 0) and its top (token id,
    logprob)."""
    return common_pb2.TokenLogprob(
        token_id=token_id,
        logprob=logprob or 0.0,
        top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
    )
