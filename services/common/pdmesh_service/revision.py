"""A worker's revision: the fingerprint of everything that must match across a KV hand-off (pure:
hashlib, json and the checkpoint's files; no torch, grpc or redis, so the gateway reads it too).

Chain: checkpoint dir + the engine's KV groups, dtype, speculative setting and KV format version →
`revision_parts` (name → short text per component) → `Revision` (`fingerprint`: a short hash of
the parts' canonical JSON) → `InstanceInfo.revision` (the registry record: the gateway pairs a
prefill rank only with a decode rank of the same revision) and `KVTarget.revision` (the prefill
rank refuses a target of another revision: `mismatch` names the parts that differ).

The components (`PARTS`):
- `checkpoint`: a hash of config.json, the safetensors index (when sharded) and, per safetensors
  file, its size, its header (tensor names, dtypes, shapes, offsets) and the first and last
  `SAMPLE_BYTES` of its data (`checkpoint_identity`). Cheap (kilobytes read, whatever the
  checkpoint's size) rather than exact: it tells apart checkpoints of other shapes, other dtypes or
  retrained weights (their sampled bytes differ), but not two that differ only in bytes it does
  not read. A draft model's checkpoint is hashed into the same part.
- `kv_layout`: the KV groups as the engine states them (`EngineCore.kv_memory`): per group its
  name, span and block size, and per pool its layers, block size and bytes per block (the entry
  width times the dtype's size); the pools' block counts and addresses are left out (they differ
  between ranks of one revision).
- `block_size`: tokens per KV block (the first group's; also inside `kv_layout`, named apart so an
  error message says "block_size").
- `dtype`: the KV pool's element type.
- `speculative`: the proposer whose KV a hand-off carries (`EngineCore.speculative`, "" = off).
- `kv_format`: the engine's `KV_FORMAT_VERSION` (what a hand-off writes, and how).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

PARTS = ("checkpoint", "kv_layout", "block_size", "dtype", "speculative", "kv_format")
FINGERPRINT_CHARS = 12  # hex characters of the fingerprint (48 bits)
PART_HASH_CHARS = 16  # hex characters of a hashed part (checkpoint, kv_layout)
SAMPLE_BYTES = 4096  # read from each end of a safetensors file's data


class PoolLike(Protocol):
    """What the fingerprint reads of a pool (`pdmesh_engine.transfer.layout.PoolLayout`)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...


class GroupLike(Protocol):
    """What the fingerprint reads of a KV group (`pdmesh_engine.transfer.layout.KVGroup`)."""

    @property
    def name(self) -> str: ...
    @property
    def span(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def pools(self) -> Sequence[PoolLike]: ...


@dataclass(frozen=True)
class Revision:
    """A rank's revision: `fingerprint` and the parts it hashes (name → text)."""

    parts: Mapping[str, str] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.parts)


def _digest(value: Any, chars: int) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:chars]


def fingerprint(parts: Mapping[str, str]) -> str:
    """The short hash of `parts`' canonical JSON (sorted keys): equal parts, equal fingerprint, in
    any process; "" for no parts (a rank that reports none)."""
    return _digest(dict(parts), FINGERPRINT_CHARS) if parts else ""


def kv_layout_part(groups: Sequence[GroupLike]) -> str:
    """The `kv_layout` part: a hash over the groups' shapes (module docstring)."""
    described = [
        {
            "name": g.name,
            "span": g.span,
            "block_size": g.block_size,
            "pools": [[p.num_layers, p.block_size, p.block_bytes] for p in g.pools],
        }
        for g in groups
    ]
    return _digest(described, PART_HASH_CHARS)


def _safetensors_identity(path: Path) -> dict[str, Any]:
    """A safetensors file's size, header and sampled data bytes (hex digests)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = f.read(header_len)
        data_start = 8 + header_len
        f.seek(data_start)
        head = f.read(SAMPLE_BYTES)
        f.seek(max(data_start, size - SAMPLE_BYTES))
        tail = f.read(SAMPLE_BYTES)
    return {
        "size": size,
        "header": hashlib.sha256(header).hexdigest(),
        "sample": hashlib.sha256(head + tail).hexdigest(),
    }


def checkpoint_identity(*model_dirs: str | Path) -> str:
    """The `checkpoint` part of the checkpoints in `model_dirs` (module docstring); ValueError when
    a directory has no config.json."""
    described = []
    for model_dir in model_dirs:
        root = Path(model_dir)
        config = root / "config.json"
        if not config.is_file():
            raise ValueError(f"{root} has no config.json: not a checkpoint directory")
        files: dict[str, Any] = {"config.json": hashlib.sha256(config.read_bytes()).hexdigest()}
        for index in sorted(root.glob("*.safetensors.index.json")):
            files[index.name] = hashlib.sha256(index.read_bytes()).hexdigest()
        for tensors in sorted(root.glob("*.safetensors")):
            files[tensors.name] = _safetensors_identity(tensors)
        described.append(files)
    return _digest(described, PART_HASH_CHARS)


def revision_parts(
    checkpoint: str,
    groups: Sequence[GroupLike],
    dtype: str,
    speculative: str,
    kv_format: int,
) -> dict[str, str]:
    """The parts of a rank's revision (`checkpoint`: `checkpoint_identity`'s answer; `groups`: its
    KV groups; `dtype`: its KV pools' element types, e.g. "float32" or "bfloat16")."""
    if not groups:
        raise ValueError("a revision needs the rank's KV groups")
    return {
        "checkpoint": checkpoint,
        "kv_layout": kv_layout_part(groups),
        "block_size": str(groups[0].block_size),
        "dtype": dtype,
        "speculative": speculative,
        "kv_format": str(kv_format),
    }


def differing_parts(mine: Mapping[str, str], theirs: Mapping[str, str]) -> list[str]:
    """The names of the parts that differ (a part only one side reports counts), in `PARTS`
    order, then any others sorted."""
    names = [*PARTS, *sorted(set(mine) | set(theirs) - set(PARTS))]
    return [n for n in names if (n in mine or n in theirs) and mine.get(n) != theirs.get(n)]


def mismatch(
    mine: str, my_parts: Mapping[str, str], theirs: str, their_parts: Mapping[str, str]
) -> str | None:
    """Why a hand-off between revisions `mine` and `theirs` must not happen (both fingerprints
    and the parts that differ, with their values), None when they match."""
    if mine == theirs:
        return None
    names = differing_parts(my_parts, their_parts)
    detail = ", ".join(
        f"{n} {my_parts.get(n, '?')!r} here, {their_parts.get(n, '?')!r} there" for n in names
    )
    return (
        f"revision {mine or '(none)'} here, {theirs or '(none)'} there"
        + (f" ({detail})" if detail else "")
        + ": prefill and decode ranks of a hand-off must run the same checkpoint, KV layout, "
        "dtype, block size, speculative setting and KV format"
    )
