"""`ForwardBatch`: everything one forward pass needs to know about the tokens it runs.

Tokens of all scheduled requests are flattened into one sequence. Sequences are ordered with the
single-token decodes first (`num_decodes` of them, one token each), then the multi-token chunks
(prefill chunks, including a preempted request's recomputation).

Legend: T tokens in the step, B sequences, M max blocks per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot (block * block_size + offset) to write
    query_start_loc: torch.Tensor  # [B + 1] int64, sequence b owns tokens [start[b], start[b+1])
    seq_lens: torch.Tensor  # [B] int32, tokens in the cache for b after this step
    block_tables: torch.Tensor  # [B, M] int32, padded with block 0
    logits_indices: torch.Tensor  # [S] int64, token rows whose logits are sampled
    num_decodes: int  # the first num_decodes sequences are single-token decodes
    query_start_list: list[int]  # host copy of query_start_loc
    seq_len_list: list[int]  # host copy of seq_lens
    # [B, M'] a second pool's tables (a windowed family's per-token state, pdmesh_engine.kv_window)
    window_tables: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_len_list)

    @classmethod
    def build(
        cls,
        token_ids: list[list[int]],
        start_positions: list[int],
        block_ids: list[list[int]],
        block_size: int,
        sample_mask: list[bool],
        device: torch.device,
        window_block_ids: list[list[int]] | None = None,
    ) -> ForwardBatch:
        """Build from per-sequence lists; sequences must already be ordered decodes-first."""
        num_decodes = 0
        while num_decodes < len(token_ids) and len(token_ids[num_decodes]) == 1:
            num_decodes += 1
        flat_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        for ids, start, blocks, sample in zip(
            token_ids, start_positions, block_ids, sample_mask, strict=True
        ):
            flat_ids.extend(ids)
            pos = range(start, start + len(ids))
            positions.extend(pos)
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in pos)
            starts.append(starts[-1] + len(ids))
            seq_lens.append(start + len(ids))
            if sample:
                logits_rows.append(starts[-1] - 1)
        width = max((len(b) for b in block_ids), default=1) or 1
        table = [i for blocks in block_ids for i in (*blocks, *[0] * (width - len(blocks)))]
        # two host-to-tensor conversions (each costs ~10 us), the fields views of them
        ints = torch.tensor(flat_ids + positions + slots + starts + logits_rows, dtype=torch.int64)
        int32s = torch.tensor(seq_lens + table, dtype=torch.int32)
        if ints.device != device:
            ints, int32s = ints.to(device), int32s.to(device)
        num_tokens, num_seqs = len(flat_ids), len(seq_lens)
        ids, pos, slot, start_loc, rows = ints.split(
            [num_tokens, num_tokens, num_tokens, num_seqs + 1, len(logits_rows)]
        )
        window_tables = None
        if window_block_ids is not None:
            w = max((len(b) for b in window_block_ids), default=1) or 1
            padded = [[*b, *[0] * (w - len(b))] for b in window_block_ids]
            window_tables = torch.tensor(padded, dtype=torch.int32, device=device)
        return cls(
            window_tables=window_tables,
            input_ids=ids,
            positions=pos,
            slot_mapping=slot,
            query_start_loc=start_loc,
            seq_lens=int32s[:num_seqs],
            block_tables=int32s[num_seqs:].view(num_seqs, width),
            logits_indices=rows,
            num_decodes=num_decodes,
            query_start_list=starts,
            seq_len_list=seq_lens,
        )
