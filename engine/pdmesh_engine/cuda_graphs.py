"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small batch on a GPU is bound by kernel launches, not by math: every layer
launches its projections, the rope, the cache write, the MLA decode attention (Triton), the router
and the fused MoE (Triton), each a few microseconds of host time. A CUDA graph records the whole
forward once and replays it as one launch.

    B decodes -> bucket b = the smallest of `buckets(max_batch)` >= B
      -> copy the step's ids, positions, cache slots, context lengths and block tables into the
         first B rows of the static inputs; rows B..b are padding (token 0 at position 0, written
         into the scratch block, a context of 1, counted in no expert load)
      -> replay graph b (captured on the first step of that bucket) -> hidden[:B]

What replaying needs of the forward, and why the CUDA path has it:
- no host sync and no host data inside: the Triton dispatchers size their grids from shapes alone
  (the MLA split count from the block-table width, the MoE's row-block map built on the device);
- the same tensors at every replay: the batch is a view of the static inputs, the block table
  always `max_blocks` wide, the expert-load counts one tensor zeroed in place
  (`ExpertLoadRecorder`);
- padding that changes nothing: the scratch block is one the KV manager never hands out, and the
  padding rows' expert loads are weighted 0 (`ExpertLoadRecorder.record(valid=...)`);
- the placement the graph read: EPLB swaps each MoE layer's placement tensors, so every graph is
  dropped when a placement object changes and recaptured on next use (moved weights are copied in
  place and need nothing).

Prefill chunks, mixed steps, batches past the largest bucket or wider than `max_blocks`, and
speculative verification (K + 1 tokens per request) run eagerly.

`capture` turns a step function into a replay function: `capture_cuda` on a GPU; the tests pass
`capture_eager` (runs the function again at each replay) to check the buffers and the padding on
CPU, with the Triton kernels under the interpreter (`pdmesh_kernels.force_triton`).

Legend: B decodes in the step, b its bucket, D hidden size, M max blocks per sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.model.deepseek_v3.model import DeepseekV3ForCausalLM
from pdmesh_engine.model.moe import ExpertLoadRecorder, LocalDispatcher

StepFn = Callable[[], torch.Tensor]
Capture = Callable[[StepFn], StepFn]


def buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (and max_batch itself)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return [*sizes, max_batch]


def capture_cuda() -> Capture:
    """Capture into CUDA graphs that share one memory pool (one graph replays at a time); two
    runs on a side stream first compile the Triton kernels and settle the allocator."""
    pool = torch.cuda.graph_pool_handle()

    def capture(step: StepFn) -> StepFn:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


def capture_eager(step: StepFn) -> StepFn:
    """The stand-in without a GPU: every replay runs the step again on the same static inputs."""
    step()
    return step


class _PaddedLoads:
    """The engine's expert-load recorder as the graphed forward sees it: padding rows count 0."""

    def __init__(self, recorder: ExpertLoadRecorder, valid: torch.Tensor) -> None:
        self.recorder, self.valid = recorder, valid

    def record(self, layer: int, slot_ids: torch.Tensor) -> None:
        self.recorder.record(layer, slot_ids, self.valid[: slot_ids.shape[0]])


class DecodeGraphs:
    """A model's decode steps by bucket: static inputs, one replay per bucket (module docstring)."""

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        kv_caches: torch.Tensor,
        scratch_block: int,
        max_batch: int,
        max_blocks: int,
        capture: Capture,
    ) -> None:
        """`scratch_block`: a KV block no request owns (padding rows write there); `max_blocks`:
        the block-table width of every graph (a batch wider than it runs eagerly)."""
        self.model, self.kv_caches, self.capture = model, kv_caches, capture
        self.buckets = buckets(max_batch)
        self.max_blocks = max_blocks
        device, block_size = kv_caches.device, kv_caches.shape[2]
        n = self.buckets[-1]
        self.pad_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), self.pad_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full(
            (n, max_blocks), scratch_block, dtype=torch.int32, device=device
        )
        self.valid = torch.zeros(n, dtype=torch.int64, device=device)
        self.rows = torch.arange(n + 1, dtype=torch.int64, device=device)
        self._graphs: dict[tuple[int, bool], StepFn] = {}
        self._placements = self._current_placements()
        self._local_experts = all(
            isinstance(m.dispatcher, LocalDispatcher) for m in model.moe_layers
        )

    def takes(self, batch: ForwardBatch) -> bool:
        """A decode-only batch within the largest bucket and the graphs' block-table width, on a
        model whose experts run in this process."""
        return (
            self._local_experts
            and batch.num_decodes == batch.num_tokens
            and 0 < batch.num_tokens <= self.buckets[-1]
            and batch.block_tables.shape[1] <= self.max_blocks
        )

    def run(self, batch: ForwardBatch, expert_load: ExpertLoadRecorder | None) -> torch.Tensor:
        """The forward of a batch that `takes` accepts: hidden states [B, D]."""
        placements = self._current_placements()
        if any(a is not b for a, b in zip(placements, self._placements, strict=True)):
            self._graphs.clear()  # EPLB switched a placement: recapture on demand
            self._placements = placements
        num = batch.num_tokens
        bucket = next(b for b in self.buckets if b >= num)
        key = (bucket, expert_load is not None)
        replay = self._graphs.get(key)
        if replay is None:  # captured over padding only: the warm-up runs touch no request
            self._load(None, 0, bucket)
            replay = self._graphs[key] = self.capture(self._step(bucket, expert_load))
        self._load(batch, num, bucket)
        return replay()[:num]

    def _load(self, batch: ForwardBatch | None, num: int, bucket: int) -> None:
        """The batch into rows [0, num) of the static inputs, padding into rows [num, bucket)."""
        if batch is not None:
            width = batch.block_tables.shape[1]
            self.input_ids[:num].copy_(batch.input_ids)
            self.positions[:num].copy_(batch.positions)
            self.slot_mapping[:num].copy_(batch.slot_mapping)
            self.seq_lens[:num].copy_(batch.seq_lens)
            self.block_tables[:num, :width].copy_(batch.block_tables)
            self.valid[:num].fill_(1)
        if bucket > num:
            self.input_ids[num:bucket].zero_()
            self.positions[num:bucket].zero_()
            self.slot_mapping[num:bucket].fill_(self.pad_slot)
            self.seq_lens[num:bucket].fill_(1)
            self.block_tables[num:bucket].fill_(self.scratch_block)
            self.valid[num:bucket].zero_()

    def _step(self, bucket: int, expert_load: ExpertLoadRecorder | None) -> StepFn:
        """The forward of `bucket` decodes over views of the static inputs. The host lists of the
        batch are placeholders: only prefill chunks and the CPU path read them."""
        batch = ForwardBatch(
            input_ids=self.input_ids[:bucket],
            positions=self.positions[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.rows[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            logits_indices=self.rows[:bucket],
            num_decodes=bucket,
            query_start_list=list(range(bucket + 1)),
            seq_len_list=[1] * bucket,
        )
        loads = (
            cast(ExpertLoadRecorder, _PaddedLoads(expert_load, self.valid))
            if expert_load is not None
            else None
        )

        def step() -> torch.Tensor:
            hidden: torch.Tensor = self.model(batch, self.kv_caches, loads)
            return hidden

        return step

    def _current_placements(self) -> list[object]:
        return [m.placement for m in self.model.moe_layers]
