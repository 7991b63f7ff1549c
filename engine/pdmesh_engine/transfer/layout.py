"""Where KV blocks lie in a block pool, and which memory regions one hand-off moves (pure: no nixl,
no protobuf).

Chain: prefill block ids + decode block ids → `coalesce` → runs → `regions` on each side → the two
equal-length descriptor lists of ONE NIXL WRITE (see `pdmesh_engine.transfer.agent`). With
speculative decoding a rank has a second pool (the proposer's KV, same block ids, its own layers and
entry width); `plan_write_pools` puts both pools' regions in the one WRITE. A family with several
KV groups (DeepSeek-V4: a full pool and a window pool, each with its own block ids) gives one
`GroupWrite` per group, and `plan_write_groups` puts them all in the one WRITE.

A rank describes its KV as `KVGroup`s (a family's spec: V3 `kv`, and `draft` for a speculative
proposer's pool on the same block ids; V4 `full`, the compressed entries, and `window`, the
per-token state a step reads only near its position). A hand-off of a prompt's KV (`plan_handoff`)
moves, per group, the blocks of the request's table (by logical block index) that the receiver's
next step needs: all of them, or, for a group with a `span`, those holding the prompt's last
`span` positions.

Legend: L layers, N blocks per layer, B tokens per block, D entry elements per token.
A pool is the contiguous tensor `[L, N, B, D]` of `pdmesh_engine.kv_cache`; block b of layer l
starts at `base_address + l * layer_stride_bytes + b * block_bytes` and is `block_bytes = B * D *
itemsize` long.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

# (local_start, remote_start, count): `count` consecutive blocks on both sides.
Run = tuple[int, int, int]
# (address, nbytes, device_id): one NIXL descriptor.
Region = tuple[int, int, int]
MEMORY_TYPES = ("DRAM", "VRAM")
# The version of what a hand-off writes: the pools' addressing (`PoolLayout`), the groups and
# which blocks of them move (`KVGroup.handoff_indices`), the entry format inside a block. Bump it
# with any change that makes a rank of the new code misread KV written by the old one: it is part
# of a worker's revision (`pdmesh_service.revision`), so the gateway never pairs the two.
KV_FORMAT_VERSION = 1


@dataclass(frozen=True)
class PoolLayout:
    """The addressing view of a block pool, as a remote agent needs it (mirrors
    `common.v1.KVLayout`)."""

    base_address: int
    num_layers: int
    num_blocks: int
    block_size: int
    block_bytes: int
    layer_stride_bytes: int
    device_id: int = 0
    memory_type: str = "DRAM"

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_blocks, self.block_size, self.block_bytes) < 1:
            raise ValueError(f"layout sizes must be positive: {self}")
        if self.layer_stride_bytes < self.num_blocks * self.block_bytes:
            raise ValueError(
                f"layer_stride_bytes {self.layer_stride_bytes} < num_blocks * block_bytes "
                f"{self.num_blocks * self.block_bytes}: layers would overlap"
            )
        if self.memory_type not in MEMORY_TYPES:
            raise ValueError(f"memory_type must be one of {MEMORY_TYPES}, got {self.memory_type!r}")

    @classmethod
    def of_tensor(cls, kv: Any) -> PoolLayout:
        """The layout of a contiguous `[L, N, B, D]` tensor (torch; duck-typed so this module stays
        pure)."""
        if kv.dim() != 4 or not kv.is_contiguous():
            raise ValueError(
                f"KV pool must be a contiguous [L, N, B, D] tensor, got shape {tuple(kv.shape)} "
                f"(contiguous={kv.is_contiguous()})"
            )
        num_layers, num_blocks, block_size, entry_dim = kv.shape
        block_bytes = block_size * entry_dim * kv.element_size()
        on_gpu = kv.device.type == "cuda"
        return cls(
            base_address=kv.data_ptr(),
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            block_bytes=block_bytes,
            layer_stride_bytes=num_blocks * block_bytes,
            device_id=kv.get_device() if on_gpu else 0,
            memory_type="VRAM" if on_gpu else "DRAM",
        )

    @property
    def total_bytes(self) -> int:
        """Bytes from the first block of layer 0 to the end of the last block of the last layer."""
        return (self.num_layers - 1) * self.layer_stride_bytes + self.num_blocks * self.block_bytes

    def block_address(self, layer: int, block: int) -> int:
        return self.base_address + layer * self.layer_stride_bytes + block * self.block_bytes

    def check_compatible(self, other: PoolLayout) -> None:
        """Prefill and decode pools must agree on what a block holds; raises ValueError
        otherwise."""
        for name in ("num_layers", "block_size", "block_bytes"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise ValueError(f"incompatible KV pools: {name} {mine} != {theirs}")

    def check_block_ids(self, block_ids: Sequence[int], what: str = "block") -> None:
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"{what} id {b} outside [0, {self.num_blocks})")


def coalesce(local_ids: Sequence[int], remote_ids: Sequence[int]) -> list[Run]:
    """Maximal runs where both id lists go up by one together, in the given order.

    `local_ids[i]` is copied to `remote_ids[i]`; the runs cover every i exactly once.
    """
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"{len(local_ids)} local blocks but {len(remote_ids)} remote blocks")
    runs: list[Run] = []
    for local, remote in zip(local_ids, remote_ids, strict=True):
        if runs:
            ls, rs, n = runs[-1]
            if local == ls + n and remote == rs + n:
                runs[-1] = (ls, rs, n + 1)
                continue
        runs.append((local, remote, 1))
    return runs


def regions(
    layout: PoolLayout, runs: Sequence[Run], side: Literal["local", "remote"] = "local"
) -> list[Region]:
    """One region per (layer, run), layer-major: `count` consecutive blocks of one layer are one
    region.

    `side` picks the run's local or remote start; both sides' lists line up entry by entry.
    """
    pick = 0 if side == "local" else 1
    out: list[Region] = []
    for layer in range(layout.num_layers):
        for run in runs:
            start, count = run[pick], run[2]
            out.append(
                (layout.block_address(layer, start), count * layout.block_bytes, layout.device_id)
            )
    return out


@dataclass(frozen=True)
class WritePlan:
    """Both descriptor lists of one WRITE: `local[i]` (addr, nbytes, dev) is copied to
    `remote[i]`."""

    local: list[Region]
    remote: list[Region]
    nbytes: int  # total bytes moved (all layers of every pool)
    num_blocks: int  # blocks per layer
    pool_nbytes: tuple[int, ...] = ()  # bytes of each pool, in the order given (sum = nbytes)
    group_nbytes: Mapping[str, int] = field(default_factory=dict)  # by KV group (plan_handoff)


def plan_write(
    local: PoolLayout, local_ids: Sequence[int], remote: PoolLayout, remote_ids: Sequence[int]
) -> WritePlan:
    """Validate a block copy local_ids[i] → remote_ids[i] (every layer) and build its regions;
    ValueError if bad."""
    return plan_write_pools([(local, remote)], local_ids, remote_ids)


def plan_write_pools(
    pools: Sequence[tuple[PoolLayout, PoolLayout]],
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
) -> WritePlan:
    """`plan_write` over several pools addressed by the same block ids (the target's KV pool and a
    speculative proposer's): each (local, remote) pair's regions, pool after pool, in one plan.
    ValueError if any pair is incompatible or the ids are bad for any pool."""
    if not pools:
        raise ValueError("nothing to write: no pools")
    if not local_ids:
        raise ValueError("nothing to write: no blocks")
    if len(local_ids) != len(remote_ids):
        raise ValueError(
            f"{len(local_ids)} local blocks but {len(remote_ids)} remote blocks "
            "(pass the remote ids of the blocks written, e.g. target.block_ids[:len(local)])"
        )
    if len(set(remote_ids)) != len(remote_ids):
        raise ValueError(f"remote block ids repeat: {list(remote_ids)}")
    runs = coalesce(local_ids, remote_ids)
    local_regions: list[Region] = []
    remote_regions: list[Region] = []
    pool_nbytes: list[int] = []
    for local, remote in pools:
        local.check_compatible(remote)
        local.check_block_ids(local_ids, "local block")
        remote.check_block_ids(remote_ids, "remote block")
        local_regions += regions(local, runs, "local")
        remote_regions += regions(remote, runs, "remote")
        pool_nbytes.append(len(local_ids) * local.num_layers * local.block_bytes)
    return WritePlan(
        local=local_regions,
        remote=remote_regions,
        nbytes=sum(pool_nbytes),
        num_blocks=len(local_ids),
        pool_nbytes=tuple(pool_nbytes),
    )


@dataclass(frozen=True)
class GroupWrite:
    """One KV group of a hand-off: pools addressed by the same block ids, and the ids to copy."""

    pools: Sequence[tuple[PoolLayout, PoolLayout]]
    local_ids: Sequence[int]
    remote_ids: Sequence[int]


def plan_write_groups(groups: Sequence[GroupWrite]) -> WritePlan:
    """`plan_write_pools` per group, every group's regions in one plan (groups with no block to
    copy are skipped); `num_blocks` counts the blocks of every group. ValueError if nothing is
    left to write or a group is bad."""
    plans = [plan_write_pools(g.pools, g.local_ids, g.remote_ids) for g in groups if g.local_ids]
    if not plans:
        raise ValueError("nothing to write: no blocks in any group")
    return WritePlan(
        local=[r for plan in plans for r in plan.local],
        remote=[r for plan in plans for r in plan.remote],
        nbytes=sum(plan.nbytes for plan in plans),
        num_blocks=sum(plan.num_blocks for plan in plans),
        pool_nbytes=tuple(n for plan in plans for n in plan.pool_nbytes),
    )


@dataclass(frozen=True)
class KVGroup:
    """Pools addressed by the same block ids, and how much of a prompt a hand-off moves of them:
    every block (`span` 0) or the blocks holding its last `span` positions. A block covers
    `block_size` tokens (0: its pools' block size); a pool may hold fewer entries a block than
    that (V4's compressed pools: one entry per `rate` tokens)."""

    name: str
    pools: tuple[PoolLayout, ...]
    span: int = 0
    block_size: int = 0

    def __post_init__(self) -> None:
        if not self.pools:
            raise ValueError(f"KV group {self.name!r} has no pools")
        counts = {p.num_blocks for p in self.pools}
        if len(counts) != 1:
            raise ValueError(f"the pools of KV group {self.name!r} differ in blocks: {counts}")
        if not self.block_size:
            object.__setattr__(self, "block_size", self.pools[0].block_size)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id across every layer of every pool."""
        return sum(p.num_layers * p.block_bytes for p in self.pools)

    def handoff_indices(self, num_tokens: int) -> range:
        """Logical blocks a hand-off of `num_tokens` computed tokens moves."""
        first = max(0, num_tokens - self.span) // self.block_size if self.span else 0
        return range(first, -(-num_tokens // self.block_size))

    def check_compatible(self, other: KVGroup) -> None:
        """ValueError naming the first difference that keeps a hand-off from working."""
        mine = (self.name, self.span, self.block_size, len(self.pools))
        theirs = (other.name, other.span, other.block_size, len(other.pools))
        if mine != theirs:
            raise ValueError(
                "incompatible KV group: (name, span, block size, pools) "
                f"{mine} here, {theirs} there"
            )
        for i, (mine, theirs) in enumerate(zip(self.pools, other.pools, strict=True)):
            try:
                mine.check_compatible(theirs)
            except ValueError as e:
                raise ValueError(f"KV group {self.name!r}, pool {i}: {e}") from e


@dataclass(frozen=True)
class KVMemory:
    """A KV group's tensors on this rank (`[L, N, B, D]` each, what an agent registers) and the
    name of the KV manager's table that addresses them (`EngineCore.kv_tables`)."""

    name: str
    tensors: tuple[Any, ...]
    span: int = 0
    table: str = ""  # "" = `name`
    block_size: int = 0  # tokens a block covers (0: the tensors' block dimension)

    def group(self) -> KVGroup:
        layouts = tuple(PoolLayout.of_tensor(t) for t in self.tensors)
        return KVGroup(self.name, layouts, self.span, self.block_size)


def check_groups(local: Sequence[KVGroup], remote: Sequence[KVGroup]) -> None:
    """ValueError unless both ranks hold the same KV groups, pool for pool."""
    names = [g.name for g in local], [g.name for g in remote]
    if names[0] != names[1]:
        raise ValueError(f"incompatible KV specs: KV groups {names[0]} here, {names[1]} there")
    for mine, theirs in zip(local, remote, strict=True):
        mine.check_compatible(theirs)


def handoff_nbytes(groups: Sequence[KVGroup], num_tokens: int) -> dict[str, int]:
    """Bytes a hand-off of `num_tokens` computed tokens moves, by KV group."""
    return {g.name: len(g.handoff_indices(num_tokens)) * g.bytes_per_block for g in groups}


def handoff_regions(
    groups: Sequence[KVGroup], tables: Mapping[str, Sequence[int]], num_tokens: int
) -> list[Region]:
    """This rank's regions of a hand-off of `num_tokens` computed tokens (its side of
    `plan_handoff`, from its own tables): per group, pool, layer, the blocks `handoff_indices`
    names in logical order, runs coalesced. Both sides' lists cover the same bytes in the same order
    (only where runs break may differ), so a digest streamed over either is one value (see
    `pdmesh_engine.transfer.digest`). ValueError when a table is too short."""
    out: list[Region] = []
    for group in groups:
        indices = group.handoff_indices(num_tokens)
        table = tables.get(group.name, ())
        if len(table) < indices.stop:
            raise ValueError(
                f"this rank holds {len(table)} blocks of KV group {group.name!r}; "
                f"{num_tokens} tokens need {indices.stop}"
            )
        ids = [table[i] for i in indices]
        runs = coalesce(ids, ids)
        for pool in group.pools:
            pool.check_block_ids(ids)
            out += regions(pool, runs)
    return out


def plan_handoff(
    local: Sequence[KVGroup],
    local_tables: Mapping[str, Sequence[int]],
    remote: Sequence[KVGroup],
    remote_tables: Mapping[str, Sequence[int]],
    num_tokens: int,
) -> WritePlan:
    """ONE WRITE's plan for the KV of `num_tokens` computed tokens: per group, the blocks its
    `handoff_indices` name, from this rank's table of the request to the receiver's (tables by
    logical block index). ValueError when the specs differ or a table is too short."""
    check_groups(local, remote)
    writes = []
    for group, theirs in zip(local, remote, strict=True):
        indices = group.handoff_indices(num_tokens)
        mine_ids, their_ids = local_tables.get(group.name, ()), remote_tables.get(group.name, ())
        for side, ids in (("this rank", mine_ids), ("the receiver", their_ids)):
            if len(ids) < indices.stop:
                raise ValueError(
                    f"{side} holds {len(ids)} blocks of KV group {group.name!r}; "
                    f"{num_tokens} tokens need {indices.stop}"
                )
        writes.append(
            GroupWrite(
                list(zip(group.pools, theirs.pools, strict=True)),
                [mine_ids[i] for i in indices],
                [their_ids[i] for i in indices],
            )
        )
    return replace(plan_write_groups(writes), group_nbytes=handoff_nbytes(local, num_tokens))
