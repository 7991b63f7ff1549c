"""The prefill rank's speculation check at a hand-off: both ranks must run the same proposer (pure:
no engine, socket or kvstore)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdmesh_engine.transfer.layout import PoolLayout
from pdmesh_engine.transfer.pb import layout_to_pb
from pdmesh_prefill.core import PushTarget, check_speculation
from pdmesh_prefill.servicer import target_from_pb
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_service.errors import FailedPrecondition

LAYOUT = PoolLayout(4096, 3, 16, 8, 256, 16 * 256)
MTP = PoolLayout(1 << 20, 1, 16, 8, 256, 16 * 256)  # one layer, the target's entry width


def test_the_same_proposer_on_both_sides_passes() -> None:
    check_speculation(PushTarget("decode-0", LAYOUT, (1, 2)), "", None)
    check_speculation(PushTarget("decode-0", LAYOUT, (1, 2), MTP, "mtp"), "mtp", MTP)


@pytest.mark.parametrize(
    ("target", "mine", "draft", "words"),
    [
        # a decode rank expecting proposer KV, a prefill rank computing none
        ((MTP, "mtp"), "", None, "runs speculative decoding 'mtp' and this prefill rank no spec"),
        # the other way round
        ((None, ""), "mtp", MTP, "runs no speculative decoding and this prefill rank speculative"),
        # two different proposers
        ((MTP, "mtp"), "draft_model:tiny-draft", MTP, "'draft_model:tiny-draft'"),
        # a setting without its pool
        ((None, "mtp"), "mtp", MTP, "decode-0 has no proposer KV pool"),
    ],
)
def test_a_mismatch_fails_fast_and_says_why(target, mine, draft, words) -> None:
    with pytest.raises(FailedPrecondition, match="--speculative-method") as failed:
        check_speculation(PushTarget("decode-0", LAYOUT, (1,), *target), mine, draft)
    assert words in str(failed.value)


def test_proposer_pools_of_another_shape_are_refused() -> None:
    wider = replace(MTP, block_bytes=512, layer_stride_bytes=16 * 512)
    with pytest.raises(FailedPrecondition, match="proposer pool of decode-0 .*block_bytes"):
        check_speculation(PushTarget("decode-0", LAYOUT, (1,), wider, "mtp"), "mtp", MTP)


def test_the_wire_target_carries_the_proposer_pool_and_setting() -> None:
    pb = common_pb2.KVTarget(
        agent_name="decode-0", layout=layout_to_pb(LAYOUT), block_ids=[3, 4], speculative="mtp"
    )
    pb.draft_layout.CopyFrom(layout_to_pb(MTP))
    assert target_from_pb(pb) == PushTarget("decode-0", LAYOUT, (3, 4), MTP, "mtp")
    pb.ClearField("draft_layout")
    pb.speculative = ""
    assert target_from_pb(pb) == PushTarget("decode-0", LAYOUT, (3, 4))
    pb.draft_layout.CopyFrom(layout_to_pb(replace(MTP, num_blocks=2, layer_stride_bytes=512)))
    with pytest.raises(ValueError, match="target block id 3 outside"):
        target_from_pb(pb)
