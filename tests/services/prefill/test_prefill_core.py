"""The prefill rank's pure core: a push's state machine, what each ending owes, the claim's verdict,
the target checks and the block plan (no engine, socket or kvstore)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.transfer.layout import KVGroup, PoolLayout
from pdmesh_prefill.core import (
    END_ACTIONS,
    PUSH_TRANSITIONS,
    EndAction,
    PushFlow,
    PushState,
    PushTarget,
    after_claim,
    check_target,
    claim_error,
    prefill_params,
)
from pdmesh_service.errors import Aborted, FailedPrecondition, InvalidArgument, Unavailable
from pdmesh_service.handoff import AlreadyFinal, Elsewhere, HandoffState, Missing, Moved, Unknown

P, S = PushState, HandoffState
LAYOUT = PoolLayout(
    base_address=4096,
    num_layers=3,
    num_blocks=16,
    block_size=8,
    block_bytes=256,
    layer_stride_bytes=16 * 256,
)


def test_push_graph_is_exactly_the_documented_one() -> None:
    edges = {(old, new) for old, news in PUSH_TRANSITIONS.items() for new in news}
    assert edges == {
        (P.COMPUTING, P.CLAIMING),
        (P.COMPUTING, P.CANCELLED),
        (P.CLAIMING, P.CLAIMED),
        (P.CLAIMING, P.REJECTED),
        (P.CLAIMING, P.CANCELLED),
        (P.CLAIMED, P.WRITING),
        (P.CLAIMED, P.CANCELLED),
        (P.WRITING, P.WRITTEN),
        (P.WRITING, P.FAILED),
    }
    assert {s for s in P if s.is_final} == {P.WRITTEN, P.FAILED, P.REJECTED, P.CANCELLED}
    # every way into a final state says what it owes, and nothing else does
    assert set(END_ACTIONS) == {(old, new) for old, new in edges if new.is_final}


def test_a_write_in_flight_is_never_cancelled_nor_is_a_record_it_may_be_writing() -> None:
    assert P.CANCELLED not in PUSH_TRANSITIONS[P.WRITING]
    for (old, new), action in END_ACTIONS.items():
        if old is P.WRITING:
            assert not action.owns_blocks  # the engine thread released them when the WRITE ended
        if S.TRANSFERRING in action.cancel_from:
            # TRANSFERRING is only cancelled where no WRITE of this rank can be in flight any more
            assert (old, new) in {
                (P.CLAIMING, P.CANCELLED),
                (P.CLAIMED, P.CANCELLED),
                (P.WRITING, P.FAILED),
            }
    # a rejected claim leaves the record alone (not ours to change), but still frees the blocks
    assert END_ACTIONS[(P.CLAIMING, P.REJECTED)] == EndAction((), owns_blocks=True)
    assert END_ACTIONS[(P.COMPUTING, P.CANCELLED)].cancel_from == (S.RESERVED,)
    assert END_ACTIONS[(P.CLAIMING, P.CANCELLED)].cancel_from == (S.RESERVED, S.TRANSFERRING)
    assert END_ACTIONS[(P.WRITING, P.FAILED)] == EndAction((S.TRANSFERRING,), forget_peer=True)


def test_flow_walks_the_happy_path_and_refuses_shortcuts() -> None:
    flow = PushFlow("r", "decode-0")
    with pytest.raises(FailedPrecondition, match="COMPUTING to WRITING"):
        flow.advance(P.WRITING)  # never write before the claim
    assert flow.state is P.COMPUTING
    assert [flow.advance(s) for s in (P.CLAIMING, P.CLAIMED, P.WRITING)] == [None, None, None]
    with pytest.raises(FailedPrecondition, match="WRITING to CANCELLED"):
        flow.advance(P.CANCELLED)
    assert flow.advance(P.WRITTEN) == EndAction()
    with pytest.raises(FailedPrecondition):
        flow.advance(P.FAILED)  # final
    assert flow.state is P.WRITTEN


@pytest.mark.parametrize(
    "outcome,state,error",
    [
        (Moved(S.RESERVED), P.CLAIMED, None),
        (AlreadyFinal(S.EXPIRED), P.REJECTED, Aborted),
        (AlreadyFinal(S.CANCELLED), P.REJECTED, Aborted),
        (Elsewhere(S.READY), P.REJECTED, Aborted),
        (Missing(), P.REJECTED, Aborted),
        (Unknown("down"), P.CANCELLED, Unavailable),
    ],
)
def test_claim_verdicts(outcome, state, error) -> None:
    assert after_claim(outcome) is state
    if error is not None:
        raised = claim_error("r", outcome)
        assert type(raised) is error and "r" in str(raised)
        flow = PushFlow("r", "decode-0", P.CLAIMING)
        assert flow.advance(state) is not None  # a legal ending from CLAIMING


def test_rejected_claim_names_the_state_it_found() -> None:
    assert "EXPIRED" in str(claim_error("r", AlreadyFinal(S.EXPIRED)))
    assert "no hand-off record" in str(claim_error("r", Missing()))


def test_target_checks() -> None:
    groups = (KVGroup("kv", (LAYOUT,)),)
    target = PushTarget("decode-0", groups, {"kv": (5, 6, 7)})
    check_target(target, groups, 17)
    with pytest.raises(InvalidArgument, match="reserved 3 blocks of KV group 'kv'"):
        check_target(target, groups, 25)
    other = PoolLayout(
        base_address=0,
        num_layers=3,
        num_blocks=16,
        block_size=16,
        block_bytes=512,
        layer_stride_bytes=16 * 512,
    )
    elsewhere = PushTarget("decode-0", (KVGroup("kv", (other,)),), {"kv": (1, 2)})
    with pytest.raises(
        FailedPrecondition, match=r"does not match this rank.s.*8, 1\) here.*16, 1\) there"
    ):
        check_target(elsewhere, groups, 17)


def test_a_windowed_group_needs_only_the_blocks_of_the_last_positions() -> None:
    # V4's layout: every block of the full group, the window group's last `span` positions only
    window = PoolLayout(1 << 20, 2, 16, 8, 64, 16 * 64)
    groups = (KVGroup("full", (LAYOUT,)), KVGroup("window", (window,), span=5))
    target = PushTarget("decode-0", groups, {"full": (1, 2, 3), "window": (0, 0, 4)})
    check_target(target, groups, 20)  # window: positions 15..19, blocks 1 and 2
    assert list(groups[1].handoff_indices(20)) == [1, 2]
    assert list(groups[1].handoff_indices(3)) == [0]
    with pytest.raises(InvalidArgument, match="KV group 'window'"):
        check_target(
            PushTarget("decode-0", groups, {"full": (1, 2, 3), "window": (0,)}), groups, 20
        )
    with pytest.raises(
        FailedPrecondition, match=r"KV groups \['full', 'window'\] here, \['full'\]"
    ):
        check_target(PushTarget("decode-0", groups[:1], {"full": (1, 2, 3)}), groups, 20)


def test_prefill_samples_one_token_and_keeps_min_tokens_for_it() -> None:
    params = prefill_params(SamplingParams(max_tokens=40, min_tokens=5, temperature=0.7, seed=3))
    assert (params.max_tokens, params.min_tokens, params.temperature, params.seed) == (1, 1, 0.7, 3)
    assert prefill_params(SamplingParams(max_tokens=4)).min_tokens == 0


def test_core_imports_no_transport_or_torch() -> None:
    code = (
        "import sys, pdmesh_prefill.core; "
        "print(sorted(m for m in ('grpc', 'redis', 'nixl', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"
