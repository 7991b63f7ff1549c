"""Property tests of `SamplingParams` validation: whatever a caller passes (a JSON body, a proto,
keyword arguments), the result is a params object whose every field is in its documented range, or
a ValueError naming a field; never another exception type."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdmesh_engine import sampling
from pdmesh_engine.sampling import SamplingParams

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None)
FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
BOUNDS = [
    0,
    1,
    -1,
    -2,
    sampling.MAX_LOGPROBS,
    sampling.INT32_MAX,
    sampling.UINT32_MAX,
    sampling._SEED_MIN,
    sampling._SEED_MAX,
]
# integers near every bound, and far past them (past the float range too)
INTS = st.sampled_from(BOUNDS).flatmap(lambda b: st.integers(b - 2, b + 2)) | st.integers(
    -(10**400), 10**400
)
FLOATS = st.floats() | st.sampled_from([0.0, 1e-50, 1.0, sampling.MAX_TEMPERATURE, 1e400])
SCALARS = st.none() | st.booleans() | INTS | FLOATS | st.text(max_size=4)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)
KEYS = st.sampled_from(FIELDS) | st.text(max_size=6)
# in-range values per field (min_tokens <= 16 <= max_tokens, so any mix of them is valid)
VALID: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(16, sampling.UINT32_MAX),
    "temperature": st.floats(0, sampling.MAX_TEMPERATURE) | st.integers(0, 100),
    "top_k": st.integers(-1, sampling.INT32_MAX),
    "top_p": st.floats(0, 1, exclude_min=True) | st.just(1),
    "min_p": st.floats(0, 1) | st.sampled_from([0, 1]),
    "seed": st.none() | st.integers(sampling._SEED_MIN, sampling._SEED_MAX),
    "stop": st.text(min_size=1) | st.lists(st.text(min_size=1), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, sampling.INT32_MAX), max_size=3),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 16),
    "logprobs": st.none() | st.integers(0, sampling.MAX_LOGPROBS),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "prior_output_tokens": st.integers(0, sampling.UINT32_MAX),
    # a grammar excludes ignore_eos and min_tokens: in-range mixes leave it out
    "grammar_kind": st.none(),
    "grammar": st.none(),
    "cache_salt": st.none() | st.text(max_size=8),
    "priority": st.integers(-(2**31), 2**31 - 1),
}


@st.composite
def near_valid(draw: st.DrawFn) -> dict[str, Any]:
    """In-range values for some fields, sometimes with one hostile entry (field or stray key)."""
    names = draw(st.sets(st.sampled_from(FIELDS)))
    values = {name: draw(VALID[name]) for name in names}
    if draw(st.booleans()):
        values[draw(KEYS)] = draw(VALUES)
    return values


def check_ranges(p: SamplingParams) -> None:
    """Every field of a constructed params object in its documented range and type."""
    ints = {
        "max_tokens": (1, sampling.UINT32_MAX),
        "top_k": (0, sampling.INT32_MAX),
        "min_tokens": (0, p.max_tokens),
        "prior_output_tokens": (0, sampling.UINT32_MAX),
        "priority": (-(2**31), 2**31 - 1),
    }
    for name, (lo, hi) in ints.items():
        if name in FIELDS:
            value = getattr(p, name)
            assert type(value) is int and lo <= value <= hi, (name, value)
    for name in ("temperature", "top_p", "min_p"):
        assert type(getattr(p, name)) is float and math.isfinite(getattr(p, name)), name
    assert 0 <= p.temperature <= sampling.MAX_TEMPERATURE
    assert 0 < p.top_p <= 1 and 0 <= p.min_p <= 1
    assert p.seed is None or (
        type(p.seed) is int and sampling._SEED_MIN <= p.seed <= sampling._SEED_MAX
    )
    assert p.logprobs is None or (
        type(p.logprobs) is int and 0 <= p.logprobs <= sampling.MAX_LOGPROBS
    )
    assert type(p.stop) is tuple and all(type(s) is str and s for s in p.stop)
    assert type(p.stop_token_ids) is tuple
    assert all(type(t) is int and 0 <= t <= sampling.INT32_MAX for t in p.stop_token_ids)
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        assert type(getattr(p, name)) is bool, name
    assert p.cache_salt is None or type(p.cache_salt) is str
    if p.grammar_kind is not None:
        assert p.grammar_kind in sampling.GRAMMAR_KINDS and not p.ignore_eos and not p.min_tokens


def _build(make: Any) -> SamplingParams | None:
    """make() or None when it raised a ValueError that names a field (any other error fails)."""
    try:
        return make()
    except ValueError as e:
        assert any(str(e).startswith(name) for name in FIELDS) or "sampling param" in str(e), e
        return None


@PROPERTY
@given(st.dictionaries(KEYS, VALUES, max_size=6))
def test_any_dict_is_valid_params_or_a_value_error(values: dict[str, Any]) -> None:
    params = _build(lambda: SamplingParams.from_dict(values))
    if params is not None:
        check_ranges(params)
        assert set(values) <= set(FIELDS)
        # a valid object survives its own field values
        assert SamplingParams(**dataclasses.asdict(params)) == params


def test_every_field_has_a_valid_strategy() -> None:
    assert set(VALID) == set(FIELDS)


@PROPERTY
@given(near_valid())
def test_near_valid_dicts_are_valid_params_or_a_value_error(values: dict[str, Any]) -> None:
    params = _build(lambda: SamplingParams.from_dict(values))
    if params is not None:
        check_ranges(params)
        for name, value in values.items():
            if value is not None and name not in ("stop", "stop_token_ids", "top_k"):
                assert getattr(params, name) == value, name


@PROPERTY
@given(st.dictionaries(st.sampled_from(FIELDS), SCALARS | st.lists(SCALARS, max_size=3)))
def test_any_keywords_are_valid_params_or_a_value_error(values: dict[str, Any]) -> None:
    params = _build(lambda: SamplingParams(**values))
    if params is not None:
        check_ranges(params)


@PROPERTY
@given(VALUES)
def test_a_body_that_is_not_an_object_is_a_value_error(body: Any) -> None:
    if not isinstance(body, dict):
        with pytest.raises(ValueError, match="JSON object"):
            SamplingParams.from_dict(body)


def test_an_integer_past_the_float_range_is_a_value_error() -> None:
    """Regression: float(10**400) raised OverflowError, which the API answered 500."""
    for name in ("temperature", "top_p", "min_p"):
        with pytest.raises(ValueError, match=name):
            SamplingParams.from_dict({name: 10**400})
