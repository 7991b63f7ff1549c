"""Fail-closed KV integrity of a hand-off: a digest of exactly the bytes its WRITE moves, carried in
the WRITE's notification and checked by the receiver before it admits the request; and a test hook
that flips one byte in flight.

Chain: prefill `plan_handoff(...).local` → `digest_regions` (xxh3-64, streamed over the regions in
order, zero-copy views of the registered KV tensors) → `encode_notification(request_id, digest)` =
the WRITE's notification → decode `decode_notification` → `Notice(request_id, digest)` →
`digest_regions` over its own `layout.handoff_regions` → equal: admit; different (or missing where
this rank checks): the hand-off fails closed.

The digest is one xxh3-64 over the hand-off's byte stream: per KV group, pool, layer, the blocks the
hand-off moves in logical order. Both sides see that stream in the same order (their regions differ
only where coalesced runs break), so each side computes it from its own blocks alone.

Modes (`--kv-digest`, `DIGEST_MODES`):
- `off`: nothing is computed, sent or checked;
- `sampled`: the hand-offs whose request id falls in 1 of every `SAMPLE_EVERY` (`is_sampled`: xxh64
  of the id, the same on every rank and run) are digested and checked; a cheap canary for
  systematic corruption (a layout bug, a bad link), not for rare flips;
- `all`: every hand-off.
Prefill and decode ranks of a mesh run one mode (`pdmesh up` passes the same worker options). A
receiver that is not `off` checks every digest it gets, and fails closed a hand-off its own mode
selects that came without one.

Fault hook (tests and `pdmesh bench chaos --corrupt-kv P`; never on by default): `CorruptKV` draws,
per hand-off, whether its WRITE corrupts one byte and where (`corrupt_plan`): the descriptor lists
are split around that byte and its source descriptor points at a scratch byte holding the original
value XOR 0xFF. The rank's own KV is never touched (its prefix cache and concurrent hand-offs of
shared blocks stay clean), the digest is that of the true bytes, and the receiver gets exactly one
flipped byte inside the notified WRITE.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import xxhash

from pdmesh_engine.transfer.layout import Region

if TYPE_CHECKING:  # the modes and the fault plan serve torch-free CLIs (`pdmesh serve kvstore`)
    import torch

DigestMode = Literal["off", "sampled", "all"]
DIGEST_MODES: tuple[DigestMode, ...] = ("off", "sampled", "all")
SAMPLE_EVERY = 16  # `sampled`: one hand-off in this many (by request id)
_TAG = "\x1fxxh3:"  # notification = request id + _TAG + 16 hex digits
_HEX_DIGITS = 16


def check_mode(mode: str) -> DigestMode:
    """`mode` as a DigestMode; ValueError for anything else."""
    if mode not in DIGEST_MODES:
        raise ValueError(f"--kv-digest must be one of {', '.join(DIGEST_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def is_sampled(request_id: str) -> bool:
    """Whether `sampled` digests this hand-off: deterministic in the id, on every rank."""
    return xxhash.xxh64_intdigest(request_id.encode()) % SAMPLE_EVERY == 0


def is_digested(mode: DigestMode, request_id: str) -> bool:
    """Whether a rank in `mode` digests (prefill) or requires a digest of (decode) a hand-off."""
    return mode == "all" or (mode == "sampled" and is_sampled(request_id))


@dataclass(frozen=True)
class Notice:
    """One WRITE's notification as the receiver reads it: whose KV landed, and the sender's digest
    of it (None: sent without one)."""

    request_id: str
    digest: int | None = None


def encode_notification(request_id: str, digest: int | None) -> bytes:
    """The WRITE's notification: the request id (utf-8), then the digest when there is one."""
    if digest is None:
        return request_id.encode()
    return f"{request_id}{_TAG}{digest:0{_HEX_DIGITS}x}".encode()


def decode_notification(message: bytes) -> Notice:
    """The inverse of `encode_notification` (a plain request id: no digest)."""
    text = message.decode("utf-8", errors="replace")
    head, tag, tail = text.rpartition(_TAG)
    if tag and len(tail) == _HEX_DIGITS:
        try:
            return Notice(head, int(tail, 16))
        except ValueError:
            pass
    return Notice(text)


class RegionReader:
    """Byte views of regions inside a rank's registered KV tensors (each `[L, N, B, D]`,
    contiguous): zero-copy on CPU, copied to the host on a GPU."""

    def __init__(self, tensors: Iterable[Any]) -> None:
        # (start address, end address, the tensor's bytes flat, numpy view of them on CPU)
        self._spans: list[tuple[int, int, torch.Tensor, np.ndarray | None]] = []
        for t in tensors:
            flat = t.view(_uint8()).reshape(-1)
            host = flat.numpy() if flat.device.type == "cpu" else None
            self._spans.append((t.data_ptr(), t.data_ptr() + flat.numel(), flat, host))

    def _find(self, address: int, nbytes: int) -> tuple[int, torch.Tensor, np.ndarray | None]:
        for start, end, flat, host in self._spans:
            if start <= address and address + nbytes <= end:
                return address - start, flat, host
        raise ValueError(f"region [{address:#x}, +{nbytes}) is not inside a registered KV tensor")

    def view(self, address: int, nbytes: int) -> torch.Tensor:
        """uint8 view of `nbytes` at `address` (on the tensor's device); ValueError when the range
        is not inside one tensor."""
        offset, flat, _ = self._find(address, nbytes)
        return flat[offset : offset + nbytes]

    def host(self, address: int, nbytes: int) -> np.ndarray:
        """The region's bytes as a numpy array (a view of the tensor's memory on CPU)."""
        offset, flat, host = self._find(address, nbytes)
        if host is not None:
            return host[offset : offset + nbytes]
        return flat[offset : offset + nbytes].cpu().numpy()


def digest_regions(reader: RegionReader, regions: Sequence[Region]) -> int:
    """xxh3-64 of the regions' bytes, in order (see the module docstring)."""
    hasher = xxhash.xxh3_64()
    for address, nbytes, _ in regions:
        hasher.update(reader.host(address, nbytes))
    return hasher.intdigest()


# ----- the fault hook ----------------------------------------------------------------------------


class CorruptKV:
    """Test hook: each hand-off's WRITE flips one byte with probability `probability` (seeded; at
    most `limit` times when `limit` > 0). `draw()` says where: a fraction of the WRITE's bytes, or
    None for a clean WRITE."""

    def __init__(self, probability: float, seed: int | str = 0, limit: int = 0) -> None:
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"corruption probability must be in [0, 1], got {probability}")
        if limit < 0:
            raise ValueError(f"corruption limit must be >= 0, got {limit}")
        self.probability, self.limit = probability, limit
        self.num_drawn = 0
        self._rng = random.Random(seed)

    def draw(self) -> float | None:
        if self.limit and self.num_drawn >= self.limit:
            return None
        if self.probability <= 0.0 or self._rng.random() >= self.probability:
            return None
        self.num_drawn += 1
        return self._rng.random()


def corrupt_plan(
    local: Sequence[Region], remote: Sequence[Region], position: int, scratch_address: int
) -> tuple[list[Region], list[Region], int]:
    """The descriptor lists with byte `position` of the WRITE (counted over `local` in order) sent
    from `scratch_address` instead: its region is split into up to three, the middle one byte long.
    Returns (local, remote, the source address of that byte)."""
    total = sum(n for _, n, _ in local)
    if not 0 <= position < total:
        raise ValueError(f"byte {position} outside a WRITE of {total} bytes")
    offset = position
    for i, ((address, nbytes, device), (r_address, _, r_device)) in enumerate(
        zip(local, remote, strict=True)
    ):
        if offset >= nbytes:
            offset -= nbytes
            continue
        pieces = [(0, offset), (offset, 1), (offset + 1, nbytes - offset - 1)]
        mine = [(address + s, n, device) for s, n in pieces if n]
        theirs = [(r_address + s, n, r_device) for s, n in pieces if n]
        mine[1 if offset else 0] = (scratch_address, 1, device)
        return (
            [*local[:i], *mine, *local[i + 1 :]],
            [*remote[:i], *theirs, *remote[i + 1 :]],
            address + offset,
        )
    raise AssertionError("unreachable: position was checked against the total")


def _uint8() -> torch.dtype:
    """torch.uint8, imported where tensors are read (the module itself imports no torch)."""
    import torch

    return torch.uint8
