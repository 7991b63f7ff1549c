"""The prefill rank's speculation check at a hand-off: both ranks must run the same proposer, and
hold the same KV groups (pure: no engine, socket or kvstore)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdmesh_engine.transfer.layout import KVGroup, PoolLayout
from pdmesh_engine.transfer.pb import group_to_pb
from pdmesh_prefill.core import PushTarget, check_speculation, check_target
from pdmesh_prefill.servicer import target_from_pb
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_service.errors import FailedPrecondition

LAYOUT = PoolLayout(4096, 3, 16, 8, 256, 16 * 256)
MTP = PoolLayout(1 << 20, 1, 16, 8, 256, 16 * 256)  # one layer, the target's entry width
PLAIN = (KVGroup("kv", (LAYOUT,)),)
SPECULATING = (*PLAIN, KVGroup("draft", (MTP,)))


def target(groups: tuple[KVGroup, ...], speculative: str = "") -> PushTarget:
    return PushTarget("decode-0", groups, {g.name: (1, 2) for g in groups}, speculative)


def test_the_same_proposer_on_both_sides_passes() -> None:
    check_speculation(target(PLAIN), "")
    check_target(target(PLAIN), PLAIN, 16)
    check_speculation(target(SPECULATING, "mtp"), "mtp")
    check_target(target(SPECULATING, "mtp"), SPECULATING, 16)


@pytest.mark.parametrize(
    ("theirs", "mine", "words"),
    [
        # a decode rank expecting proposer KV, a prefill rank computing none
        ("mtp", "", "runs speculative decoding 'mtp' and this prefill rank no spec"),
        # the other way round
        ("", "mtp", "runs no speculative decoding and this prefill rank speculative"),
        # two different proposers
        ("mtp", "draft_model:tiny-draft", "'draft_model:tiny-draft'"),
    ],
)
def test_a_mismatch_fails_fast_and_says_why(theirs: str, mine: str, words: str) -> None:
    with pytest.raises(FailedPrecondition, match="--speculative-method") as failed:
        check_speculation(target(SPECULATING, theirs), mine)
    assert words in str(failed.value)


def test_a_setting_without_its_pool_is_refused() -> None:
    with pytest.raises(FailedPrecondition, match=r"\['kv', 'draft'\] here, \['kv'\] there"):
        check_target(target(PLAIN, "mtp"), SPECULATING, 16)


def test_proposer_pools_of_another_shape_are_refused() -> None:
    wider = replace(MTP, block_bytes=512, layer_stride_bytes=16 * 512)
    theirs = (*PLAIN, KVGroup("draft", (wider,)))
    with pytest.raises(FailedPrecondition, match="KV group 'draft', pool 0: .*block_bytes"):
        check_target(target(theirs, "mtp"), SPECULATING, 16)


def test_the_wire_target_carries_the_groups_and_setting() -> None:
    pb = common_pb2.KVTarget(
        agent_name="decode-0",
        speculative="mtp",
        groups=[group_to_pb(SPECULATING[0], [3, 4]), group_to_pb(SPECULATING[1], [3, 4])],
    )
    expected = PushTarget("decode-0", SPECULATING, {"kv": (3, 4), "draft": (3, 4)}, "mtp")
    assert target_from_pb(pb) == expected
    del pb.groups[1]
    pb.speculative = ""
    assert target_from_pb(pb) == PushTarget("decode-0", PLAIN, {"kv": (3, 4)})
    pb.groups.append(
        group_to_pb(KVGroup("draft", (replace(MTP, num_blocks=2, layer_stride_bytes=512),)), [3, 4])
    )
    with pytest.raises(ValueError, match="KV group 'draft' block id 3 outside"):
        target_from_pb(pb)
