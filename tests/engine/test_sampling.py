"""SamplingParams validation / normalisation and the stop-string search."""

from __future__ import annotations

import math

import pytest

from pdmesh_engine.sampling import MAX_LOGPROBS, SamplingParams, find_stop_string


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "1"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 16.0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": 101.0}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": False}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"seed": "7"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
    ],
)
def test_bad_values_are_rejected_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
    # from_dict goes through the same checks (None is "default" there, so skip that case).
    if None not in kwargs.values():
        with pytest.raises(ValueError, match=field):
            SamplingParams.from_dict(kwargs)


def test_range_is_stated_in_the_message() -> None:
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\], got 21"):
        SamplingParams(logprobs=21)


def test_good_values_are_accepted_and_normalised() -> None:
    p = SamplingParams(
        max_tokens=1,
        temperature=0,
        top_k=-1,
        top_p=1,
        min_p=1,
        seed=-3,
        stop=["a", "bc"],
        stop_token_ids=[0, 5],
        min_tokens=1,
        logprobs=0,
    )
    assert p.stop == ("a", "bc") and p.stop_token_ids == (0, 5)
    assert p.top_k == 0  # -1 and 0 both mean disabled
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert p.is_greedy
    assert SamplingParams(stop="END").stop == ("END",)
    assert (
        SamplingParams(temperature=100, top_k=1, logprobs=MAX_LOGPROBS, seed=2**64 - 1).top_k == 1
    )
    assert not SamplingParams().is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy  # below the greedy epsilon
    # hashable once normalised
    assert hash(SamplingParams(stop=["x"])) == hash(SamplingParams(stop=("x",)))


def test_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.max_tokens = 3  # type: ignore[misc]


def test_from_dict() -> None:
    p = SamplingParams.from_dict(
        {
            "max_tokens": 8,
            "temperature": 0.5,
            "stop": ["\n"],
            "seed": None,
            "top_p": None,
            "ignore_eos": True,
        }
    )
    assert p == SamplingParams(max_tokens=8, temperature=0.5, stop=("\n",), ignore_eos=True)
    assert SamplingParams.from_dict({}) == SamplingParams()
    with pytest.raises(
        ValueError,
        match=r"unknown sampling parameter\(s\) 'frequency_penalty'.*allowed: max_tokens",
    ):
        SamplingParams.from_dict({"max_tokens": 4, "frequency_penalty": 0.1})
    with pytest.raises(ValueError, match="JSON object"):
        SamplingParams.from_dict([("max_tokens", 4)])  # type: ignore[arg-type]


def test_validate_for_vocab() -> None:
    SamplingParams(stop_token_ids=(0, 99)).validate_for_vocab(100)
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 100\).*\[100\]"):
        SamplingParams(stop_token_ids=(1, 100)).validate_for_vocab(100)


def test_find_stop_string_across_chunk_boundary() -> None:
    text = "hello wor" + "ld END"
    assert find_stop_string("hello wor", ("world",), 3) is None
    assert find_stop_string(text, ("world",), len("ld END")) == (6, "world")
    # stop split over three chunks, only its last char new
    assert find_stop_string("abc<|st", ("<|stop|>",), 2) is None
    assert find_stop_string("abc<|stop|>", ("<|stop|>",), 1) == (3, "<|stop|>")


def test_find_stop_string_earliest_of_several() -> None:
    text = "xx BBB yy AAA"
    assert find_stop_string(text, ("AAA", "BBB"), len(text)) == (3, "BBB")
    # same start: the shorter one (completed first in a char-by-char stream) wins
    assert find_stop_string("q abcd", ("abcd", "ab"), 4) == (2, "ab")


def test_find_stop_string_absent_and_tail_only() -> None:
    assert find_stop_string("nothing here", ("STOP",), 5) is None
    assert find_stop_string("anything", (), 8) is None
    assert find_stop_string("STOP", ("STOP",), 0) is None  # no new text, nothing to find
    # A stop wholly in old text (before the tail window) is not reported again.
    assert find_stop_string("STOP and then more", ("STOP",), 4) is None
    # The window is new_text_len + len(stop) - 1: a match starting 3 chars before the new text
    # counts.
    assert find_stop_string("..STOP", ("STOP",), 1) == (2, "STOP")
    assert find_stop_string("..STOPx", ("STOP",), 1) is None
    # new_text_len larger than the text is clamped
    assert find_stop_string("STOP", ("STOP",), 100) == (0, "STOP")
    with pytest.raises(ValueError, match="new_text_len"):
        find_stop_string("abc", ("a",), -1)
