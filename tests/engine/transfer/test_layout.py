"""Pure block-layout arithmetic: coalesced regions cover exactly the bytes a per-block copy
would."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from pdmesh_engine.transfer.layout import PoolLayout, coalesce, plan_write, regions
from pdmesh_engine.transfer.pb import layout_from_pb, layout_to_pb


def _layout(
    base: int, num_layers: int = 3, num_blocks: int = 32, block_bytes: int = 256
) -> PoolLayout:
    return PoolLayout(
        base_address=base,
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=4,
        block_bytes=block_bytes,
        layer_stride_bytes=num_blocks * block_bytes,
    )


def _byte_map(local_regions, remote_regions) -> dict[int, int]:
    """remote byte address -> local byte address, from two aligned region lists."""
    mapping = {}
    for (la, ln, _), (ra, rn, _) in zip(local_regions, remote_regions, strict=True):
        assert ln == rn
        for i in range(ln):
            assert ra + i not in mapping, "a remote byte written twice"
            mapping[ra + i] = la + i
    return mapping


def _naive_map(local: PoolLayout, remote: PoolLayout, local_ids, remote_ids) -> dict[int, int]:
    mapping = {}
    for layer in range(local.num_layers):
        for lb, rb in zip(local_ids, remote_ids, strict=True):
            for i in range(local.block_bytes):
                mapping[remote.block_address(layer, rb) + i] = local.block_address(layer, lb) + i
    return mapping


def test_of_tensor_matches_the_pool_tensor():
    kv = torch.zeros(3, 10, 4, 6, dtype=torch.bfloat16)
    layout = PoolLayout.of_tensor(kv)
    assert layout.block_bytes == 4 * 6 * 2 and layout.layer_stride_bytes == 10 * 4 * 6 * 2
    assert layout.total_bytes == kv.numel() * kv.element_size()
    assert layout.block_address(2, 7) == kv[2, 7].data_ptr()
    assert (layout.memory_type, layout.device_id) == ("DRAM", 0)
    with pytest.raises(ValueError, match="contiguous"):
        PoolLayout.of_tensor(kv.transpose(0, 1))


def test_coalesce_finds_maximal_joint_runs():
    assert coalesce([4, 5, 6, 9, 10, 0], [1, 2, 3, 4, 5, 7]) == [(4, 1, 3), (9, 4, 2), (0, 7, 1)]
    # local consecutive, remote not
    assert coalesce([1, 2, 3], [5, 9, 10]) == [(1, 5, 1), (2, 9, 2)]
    assert coalesce([], []) == []
    with pytest.raises(ValueError, match="2 local blocks but 1"):
        coalesce([1, 2], [3])


def test_a_run_is_one_region_per_layer():
    local, remote = _layout(1000), _layout(10**6, num_blocks=64)
    runs = coalesce([3, 4, 5], [10, 11, 12])
    got = regions(local, runs), regions(remote, runs, "remote")
    assert got[0] == [(1000 + layer * 32 * 256 + 3 * 256, 3 * 256, 0) for layer in range(3)]
    assert got[1] == [(10**6 + layer * 64 * 256 + 10 * 256, 3 * 256, 0) for layer in range(3)]


@pytest.mark.parametrize("seed", range(6))
def test_random_plans_cover_the_same_bytes_as_per_block_copies(seed: int):
    rng = random.Random(seed)
    local, remote = (
        _layout(4096, num_blocks=24, block_bytes=8),
        _layout(1 << 20, num_blocks=40, block_bytes=8),
    )
    count = rng.randint(1, 20)
    local_ids = rng.sample(range(24), count) if seed % 2 else sorted(rng.sample(range(24), count))
    start = rng.randint(0, 40 - count)
    remote_ids = (
        list(range(start, start + count)) if seed % 3 == 0 else rng.sample(range(40), count)
    )
    plan = plan_write(local, local_ids, remote, remote_ids)
    assert _byte_map(plan.local, plan.remote) == _naive_map(local, remote, local_ids, remote_ids)
    assert plan.nbytes == sum(n for _, n, _ in plan.local) == count * 3 * 8
    assert len(plan.local) == 3 * len(coalesce(local_ids, remote_ids)) <= 3 * count


def test_plan_write_rejects_bad_requests():
    local, remote = _layout(0), _layout(1 << 20)
    with pytest.raises(ValueError, match="no blocks"):
        plan_write(local, [], remote, [])
    with pytest.raises(ValueError, match="1 local blocks but 2 remote"):
        plan_write(local, [1], remote, [1, 2])
    with pytest.raises(ValueError, match="remote block id 32 outside"):
        plan_write(local, [1], remote, [32])
    with pytest.raises(ValueError, match="repeat"):
        plan_write(local, [1, 2], remote, [5, 5])
    with pytest.raises(ValueError, match="block_bytes 256 != 512"):
        plan_write(local, [1], _layout(1 << 20, block_bytes=512), [1])
    with pytest.raises(ValueError, match="num_layers"):
        local.check_compatible(_layout(0, num_layers=4))
    local.check_compatible(_layout(1 << 30, num_blocks=5))  # pool sizes may differ


def test_layout_validation_and_protobuf_round_trip():
    layout = _layout(123456, num_blocks=7)
    assert layout_from_pb(layout_to_pb(layout)) == layout
    with pytest.raises(ValueError, match="positive"):
        layout_from_pb(type(layout_to_pb(layout))())  # an unset layout
    with pytest.raises(ValueError, match="overlap"):
        PoolLayout(0, 2, 8, 4, 64, layer_stride_bytes=64)
    with pytest.raises(ValueError, match="memory_type"):
        PoolLayout(0, 2, 8, 4, 64, 512, memory_type="HBM")


def test_layout_module_is_pure():
    code = (
        "import sys, pdmesh_engine.transfer.layout; "
        "print(sorted(m for m in ('nixl', 'torch', 'google.protobuf') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


def test_groups_with_their_own_ids_go_in_one_plan():
    from pdmesh_engine.transfer.layout import GroupWrite, plan_write_groups

    full = (_layout(0), _layout(10**6))
    window = (
        _layout(2 * 10**6, num_blocks=8, block_bytes=64),
        _layout(3 * 10**6, num_blocks=8, block_bytes=64),
    )
    groups = [GroupWrite([full], [1, 2, 3], [7, 8, 9]), GroupWrite([window], [5], [2])]
    plan = plan_write_groups(groups)
    alone = [plan_write(*g.pools[0][:1], g.local_ids, g.pools[0][1], g.remote_ids) for g in groups]
    assert plan.local == alone[0].local + alone[1].local
    assert plan.remote == alone[0].remote + alone[1].remote
    assert plan.nbytes == 3 * 3 * 256 + 1 * 3 * 64 and plan.num_blocks == 4
    assert plan_write_groups([groups[0], GroupWrite([window], [], [])]).local == alone[0].local
    with pytest.raises(ValueError, match="no blocks in any group"):
        plan_write_groups([GroupWrite([window], [], [])])
    with pytest.raises(ValueError, match="outside"):
        plan_write_groups([GroupWrite([window], [9], [1])])
