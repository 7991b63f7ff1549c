"""The kernel's account of this process's memory (/proc/self/smaps), for tests of where tensors
lie."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


def huge_bytes_in(start: int, end: int) -> int:
    """Bytes of huge pages in the mappings that overlap the addresses [start, end)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's header: "lo-hi perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


def huge_bytes(tensor: torch.Tensor) -> int:
    """Bytes of huge pages in the mappings that hold the tensor's storage."""
    start = tensor.untyped_storage().data_ptr()
    return huge_bytes_in(start, start + tensor.untyped_storage().nbytes())


def advised_in(start: int, end: int) -> bool:
    """Whether every mapping over the whole huge pages inside [start, end) carries the huge-page
    advice ("hg"); advice splits a mapping at its bounds, so the edges may lie in others."""
    huge = 2 << 20
    start, end = -(-start // huge) * huge, end // huge * huge
    found, inside = False, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == "VmFlags:":
            if "hg" not in line.split()[1:]:
                return False
            found = True
    return found


def kernel_grants_huge_pages() -> bool:
    """Whether the kernel backs a fresh advised 8 MiB region with huge pages right now (it gives
    none when memory is fragmented or short: advice is a request, not a promise)."""
    from pdmesh_engine import huge_pages

    probe = huge_pages.empty(8 << 20 >> 2, torch.float32)
    probe.fill_(1.0)
    return huge_bytes_in(probe.data_ptr(), probe.data_ptr() + probe.nbytes) > 0


def expect_huge(start: int, end: int, at_least: int) -> None:
    """[start, end) was advised, and holds `at_least` bytes of huge pages unless the kernel shows
    (by a probe) that it has none to give now: then the test is skipped, not passed."""
    assert advised_in(start, end), "the memory was not advised for huge pages"
    if huge_bytes_in(start, end) >= at_least:
        return
    if not kernel_grants_huge_pages():
        pytest.skip("the kernel has no huge pages to spare at the moment")
    assert huge_bytes_in(start, end) >= at_least
