"""Huge pages under the CPU path's weights and KV pool (`huge_pages`), read back from the kernel's
own account of the process's memory (/proc/self/smaps)."""

from __future__ import annotations

import platform

import pytest
import torch
from memory_maps import expect_huge, huge_bytes, huge_pages_available

from pdmesh_engine import huge_pages
from pdmesh_engine.model.deepseek_v3.runtime import allocate_kv_memory

pytestmark = pytest.mark.skipif(
    not huge_pages_available(), reason="transparent huge pages are not available on this kernel"
)


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
    start = weights.data_ptr()
    expect_huge(start, start + weights.nbytes, at_least=2 << 20)


def test_kv_pool_is_zeroed_in_huge_pages() -> None:
    pool = allocate_kv_memory(2, 256, 16, 160, torch.float32, torch.device("cpu"))  # 5 MiB
    assert pool.shape == (2, 256, 16, 160) and pool.is_contiguous()
    assert not pool.any()
    start = pool.data_ptr()
    expect_huge(start, start + pool.nbytes, at_least=2 << 20)


def test_empty_starts_on_a_huge_page_and_is_backed_by_them() -> None:
    table = huge_pages.empty(40 << 20 >> 1, torch.bfloat16)  # 40 MiB: always a fresh mapping
    assert table.numel() == 40 << 20 >> 1 and table.dtype == torch.bfloat16
    assert table.data_ptr() % huge_pages.HUGE_PAGE == 0
    table.fill_(1.5)  # the first touch, after the advice
    expect_huge(table.data_ptr(), table.data_ptr() + table.nbytes, at_least=table.nbytes)
    assert bool((table == 1.5).all())


def test_small_tensors_are_left_alone() -> None:
    assert huge_pages.advise(torch.zeros(1000), collapse=True) == 0
    assert huge_pages.advise_all([torch.zeros(10), torch.zeros(1 << 18)]) == 0  # 1 MiB


def test_empty_on_reused_heap_is_still_backed_by_huge_pages() -> None:
    # glibc raises its mmap threshold after freeing a big block, so a later allocation of that size
    # may come from heap touched before, in small pages, where advice alone changes nothing
    for _ in range(4):
        torch.ones(12 << 20 >> 2).sum()
        torch.ones(40 << 20 >> 2).sum()
        table = huge_pages.empty(12 << 20 >> 2, torch.float32)
        table.fill_(1.0)
        expect_huge(table.data_ptr(), table.data_ptr() + table.nbytes, at_least=table.nbytes)
