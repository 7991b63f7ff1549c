"""Huge pages under the CPU path's weights and KV pool (`huge_pages`), read back from the kernel's
own account of the process's memory (/proc/self/smaps)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from pdmesh_engine import huge_pages
from pdmesh_engine.model_runner import allocate_kv_memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are not available on this kernel",
)


def huge_bytes(tensor: torch.Tensor) -> int:
    """Bytes of huge pages in the mappings that hold the tensor's storage."""
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's header: "lo-hi perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


def test_filled_memory_is_collapsed_into_huge_pages_with_its_values() -> None:
    weights = torch.randn(16 << 20 >> 2)  # 16 MiB, filled: only a collapse can help it
    before = weights.clone()
    if huge_bytes(weights) >= 8 << 20:
        pytest.skip("the allocator already handed out huge pages")
    advised = huge_pages.advise_all([weights, weights[1:], weights.view(4, -1).t()])
    assert advised >= 14 << 20  # the aligned interior, counted once for the three views
    assert torch.equal(weights, before)
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    if (major, minor) < (6, 1):
        pytest.skip("MADV_COLLAPSE needs Linux 6.1")
    assert huge_bytes(weights) >= 2 << 20


def test_kv_pool_is_zeroed_in_huge_pages() -> None:
    pool = allocate_kv_memory(2, 256, 16, 160, torch.float32, torch.device("cpu"))  # 5 MiB
    assert pool.shape == (2, 256, 16, 160) and pool.is_contiguous()
    assert not pool.any()
    assert huge_bytes(pool) >= 2 << 20


def test_small_tensors_are_left_alone() -> None:
    assert huge_pages.advise(torch.zeros(1000), collapse=True) == 0
    assert huge_pages.advise_all([torch.zeros(10), torch.zeros(1 << 18)]) == 0  # 1 MiB
