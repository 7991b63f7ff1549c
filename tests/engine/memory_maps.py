"""The kernel's account of this process's memory (/proc/self/smaps), for tests of where tensors
lie."""

from __future__ import annotations

from pathlib import Path

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
