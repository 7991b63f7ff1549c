"""A check the speculative-decoding tests share: a request's drafts depend only on its tokens."""

from __future__ import annotations

from collections.abc import Callable

from pdmesh_engine import EngineCore, SamplingParams


def check_drafts_repeat(
    engine: EngineCore, request_id: str, fresh: Callable[[], EngineCore]
) -> int:
    """Step `engine` until `request_id` ends; after each step, a `fresh()` engine given the
    request's tokens but the last must reach the same tokens and the same drafts in one step
    (what the proposer keeps between steps is a function of the tokens). Returns the steps
    checked."""
    checked = 0
    while engine.has_unfinished:
        engine.step()
        request = engine.scheduler.requests.get(request_id)
        if request is None:
            break
        other = fresh()
        other_id = other.add_request(
            request.all_token_ids[:-1],
            SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        )
        other.step()
        again = other.scheduler.requests[other_id]
        assert again.all_token_ids == request.all_token_ids
        assert again.spec_token_ids == request.spec_token_ids
        checked += 1
    return checked
