"""What DeepSeek-V4 caches, where it lives, and the per-step index tensors that address it.

Per layer, two kinds of state (the spec the KV manager, admission and transfer work from):
- **per token** (`window` group): the window's K=V entry (`head_dim`) of every layer, and, for a
  compressed layer, the compressor's projected rows (kv and gate, and the indexer's for CSA). A
  step reads these rows only for the last `V4Config.window_span` positions: the attention window
  (W - 1 tokens before the query), the open compression window, and CSA's previous window, whose
  first series overlaps the current one. A block boundary is a window boundary for every compress
  rate (the block size is a multiple of each), so nothing is pending across it.
- **per entry** (`compressed` group): one entry per `rate` tokens: CSA's compressed KV and
  indexer key (rate 4 in Flash), HCA's compressed KV (rate 128). Entry e summarises tokens
  [e * rate, (e + 1) * rate) and is visible to a query at position p once e < (p + 1) // rate.

Both groups are addressed by the request's block table: token p's rows sit in block p // B at
offset p % B; entry e of a kind of rate r in block (e * r) // B at offset (e * r % B) // r.

Legend: L layers, N blocks, B block size, T tokens in the step, S sequences, W window, E entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdmesh_engine import huge_pages
from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.model.deepseek_v4.config import CSA, HCA, V4Config
from pdmesh_engine.transfer.layout import KVMemory


def default_block_size(config: V4Config) -> int:
    """The smallest power of two >= 16 that every compress rate of the model divides."""
    rates = [config.rate(kind) for kind in (CSA, HCA) if kind in config.layer_types]
    need = math.lcm(*rates) if rates else 1
    size = 16
    while size % need:
        size *= 2
    return size


def check_block_size(config: V4Config, block_size: int) -> None:
    """ValueError unless a block boundary is a window boundary of every compressed layer."""
    for kind in (CSA, HCA):
        rate = config.rate(kind)
        if kind in config.layer_types and block_size % rate:
            raise ValueError(
                f"block_size {block_size} is not a multiple of the {kind} compress rate {rate}: "
                f"a block boundary must close every compression window (use a multiple of "
                f"{default_block_size(config)})"
            )


def row_width(config: V4Config, kind: str) -> int:
    """Per-token compressor row of a layer kind: kv and gate, 2 series each for CSA."""
    return 4 * config.head_dim if kind == CSA else 2 * config.head_dim


@dataclass(frozen=True)
class KVBytes:
    """Bytes per token of context, by what holds them (at `dtype_bytes` per element)."""

    window_per_layer: int  # while the token is in the window
    rows: dict[str, int]  # per compressed layer, while the token's window is open
    entries: dict[str, float]  # per compressed layer, for the whole context

    def describe(self, config: V4Config) -> str:
        kinds = {k: len(config.layers_of(k)) for k in (CSA, HCA)}
        context = sum(self.entries[k] * n for k, n in kinds.items())
        parts = ", ".join(
            f"{k.split('_')[0]} x{n}: {self.entries[k]:.1f} B/token/layer"
            for k, n in kinds.items()
            if n
        )
        return (
            f"V4 KV: {context:.1f} bytes per token of context ({parts}); window "
            f"{self.window_per_layer} B/token/layer over {config.num_hidden_layers} layers for "
            f"the last {config.sliding_window} tokens"
        )


def kv_bytes(config: V4Config, dtype_bytes: int) -> KVBytes:
    hd, ihd = config.head_dim, config.index_head_dim
    return KVBytes(
        window_per_layer=hd * dtype_bytes,
        rows={
            k: row_width(config, k) * dtype_bytes + (4 * ihd * dtype_bytes if k == CSA else 0)
            for k in (CSA, HCA)
        },
        entries={
            CSA: (hd + ihd) * dtype_bytes / config.rate(CSA),
            HCA: hd * dtype_bytes / config.rate(HCA),
        },
    )


class V4Cache:
    """The pool tensors: `num_blocks` full-pool blocks (compressed entries) and
    `num_window_blocks` window-pool blocks (per-token window K=V and compressor rows), both of
    `block_size` tokens (see pdmesh_engine.kv_window for who holds which)."""

    def __init__(
        self,
        config: V4Config,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_window_blocks: int | None = None,
    ) -> None:
        check_block_size(config, block_size)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.window_span = config.window_span
        self.num_window_blocks = num_window_blocks or num_blocks
        hd, ihd = config.head_dim, config.index_head_dim

        def zeros(layers: int, blocks: int, per_block: int, width: int) -> torch.Tensor:
            return huge_pages.zeros((layers, blocks, per_block, width), dtype, device)

        n_csa, n_hca = len(config.layers_of(CSA)), len(config.layers_of(HCA))
        r_csa, r_hca = config.rate(CSA), config.rate(HCA)
        w = self.num_window_blocks
        self.window = zeros(config.num_hidden_layers, w, block_size, hd)
        self.csa_rows = zeros(n_csa, w, block_size, 4 * hd)
        self.csa_index_rows = zeros(n_csa, w, block_size, 4 * ihd)
        self.hca_rows = zeros(n_hca, w, block_size, 2 * hd)
        self.csa_kv = zeros(n_csa, num_blocks, block_size // r_csa, hd)
        self.csa_index = zeros(n_csa, num_blocks, block_size // r_csa, ihd)
        self.hca_kv = zeros(n_hca, num_blocks, block_size // r_hca, hd)
        # layer id -> its index among the layers of its kind
        self.kind_index = {
            layer: i for kind in (CSA, HCA) for i, layer in enumerate(config.layers_of(kind))
        }

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [*self.window_tensors(), *self.full_tensors()]

    def window_tensors(self) -> list[torch.Tensor]:
        return [self.window, self.csa_rows, self.csa_index_rows, self.hca_rows]

    def full_tensors(self) -> list[torch.Tensor]:
        return [self.csa_kv, self.csa_index, self.hca_kv]

    def memory(self) -> list[KVMemory]:
        """The hand-off's KV groups (what a NIXL agent registers): `full`, every block of a
        prompt; `window`, the blocks holding the positions the receiver's next step reads, which
        may compute the prompt's last token again (`window_span` + 1 positions back). Kinds the
        model has no layer of hold nothing and are left out."""
        span = self.window_span + 1
        return [
            KVMemory(
                "full",
                tuple(t for t in self.full_tensors() if t.shape[0]),
                block_size=self.block_size,
            ),
            KVMemory("window", tuple(t for t in self.window_tensors() if t.shape[0]), span=span),
        ]

    @staticmethod
    def block_bytes(config: V4Config, block_size: int, dtype_bytes: int) -> tuple[int, int]:
        """(bytes of one full-pool block, bytes of one window-pool block)."""
        b = kv_bytes(config, dtype_bytes)
        n = {k: len(config.layers_of(k)) for k in (CSA, HCA)}
        full = sum(b.entries[k] * n[k] for k in (CSA, HCA)) * block_size
        window = (
            b.window_per_layer * config.num_hidden_layers + sum(b.rows[k] * n[k] for k in n)
        ) * block_size
        return int(math.ceil(full)), int(window)


@dataclass
class Closing:
    """The compression windows that close in this step, for one layer kind (C of them)."""

    write_slots: torch.Tensor  # [C] flat entry slot to write
    positions: torch.Tensor  # [C] the window's first token position (its rope position)
    row_slots: torch.Tensor  # [C, span] flat row slots of the tokens the entry reads
    first: torch.Tensor  # [C] bool: window 0 (CSA: no previous window)


@dataclass
class Entries:
    """Addressing of one layer kind's entries in this step."""

    rate: int
    slots: torch.Tensor  # [S, E] flat entry slot of entry e of sequence s
    visible: torch.Tensor  # [T] entries visible to each token: (p + 1) // rate
    closing: Closing


@dataclass
class V4Step:
    """Index tensors of one forward step, shared by every layer."""

    positions: torch.Tensor  # [T]
    token_seq: torch.Tensor  # [T] the sequence of each token
    write_slots: torch.Tensor  # [T] flat per-token row slot of each token
    window_slots: torch.Tensor  # [T, W] flat row slots of positions p - W + 1 .. p
    window_valid: torch.Tensor  # [T, W] bool: position >= 0
    entries: dict[str, Entries]  # by compressed layer kind

    @classmethod
    def build(cls, batch: ForwardBatch, config: V4Config, block_size: int) -> V4Step:
        """`batch.block_tables` address the entries; `batch.window_tables` (the full tables when
        absent) the per-token rows."""
        device = batch.input_ids.device
        table = batch.block_tables.long()
        window_table = (
            batch.window_tables if batch.window_tables is not None else batch.block_tables
        ).long()
        lens = torch.tensor(
            [
                batch.query_start_list[i + 1] - batch.query_start_list[i]
                for i in range(batch.num_seqs)
            ]
        )
        token_seq = torch.repeat_interleave(torch.arange(batch.num_seqs), lens).to(device)
        positions = batch.positions

        def row_slot(seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return window_table[seq, pos // block_size] * block_size + pos % block_size

        w = config.sliding_window
        key_pos = positions[:, None] - (w - 1) + torch.arange(w, device=device)
        window_valid = key_pos >= 0
        window_slots = row_slot(token_seq[:, None].expand_as(key_pos), key_pos.clamp(min=0))
        entries = {
            kind: _entries(batch, table, config.rate(kind), block_size, kind == CSA, row_slot)
            for kind in (CSA, HCA)
            if kind in config.layer_types
        }
        write_slots = row_slot(token_seq, positions)
        return cls(positions, token_seq, write_slots, window_slots, window_valid, entries)


def _entries(batch, table, rate, block_size, overlapped, row_slot) -> Entries:  # type: ignore[no-untyped-def]
    device = table.device
    per_block = block_size // rate
    num_entries = max(max(batch.seq_len_list) // rate, 1)
    entry_pos = torch.arange(num_entries, device=device) * rate
    slots = table[:, entry_pos // block_size] * per_block + (entry_pos % block_size) // rate
    seqs: list[int] = []
    windows: list[int] = []
    for s, end in enumerate(batch.seq_len_list):
        start = end - (batch.query_start_list[s + 1] - batch.query_start_list[s])
        closing = range(start // rate, end // rate)
        seqs.extend([s] * len(closing))
        windows.extend(closing)
    seq_t = torch.tensor(seqs, dtype=torch.int64, device=device)
    win_t = torch.tensor(windows, dtype=torch.int64, device=device)
    span = 2 * rate if overlapped else rate
    first_row = win_t * rate - (rate if overlapped else 0)
    row_pos = first_row[:, None] + torch.arange(span, device=device)
    closing = Closing(
        write_slots=slots[seq_t, win_t]
        if windows
        else torch.zeros(0, dtype=torch.int64, device=device),
        positions=win_t * rate,
        row_slots=row_slot(seq_t[:, None].expand_as(row_pos), row_pos.clamp(min=0)),
        first=win_t == 0,
    )
    return Entries(rate, slots, (batch.positions + 1) // rate, closing)
