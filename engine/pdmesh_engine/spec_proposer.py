"""Draft proposers of speculative decoding: the checkpoint's MTP layer, or a separate draft model.

Both run once per step after the target's forward (`SpecDecoder.execute`), over the same
`ForwardBatch` (same positions, same block tables), so their KV covers every position the target
computed, then draft autoregressively with single-token batches. Their KV lives in a cache tensor
of their own, `[layers, num_blocks, block_size, entry]`, addressed by the target's block ids: one
allocation serves both caches, so freeing, preemption and prefix caching stay one mechanism (a
block's draft entries are written in the same steps as its target entries, and only verified
positions are ever hashed). Drafting writes past the scheduled tokens, into the positions the
scheduler reserved as lookahead (`num_lookahead_tokens`); those are rewritten before they are read
as verified context.

Positions: the proposal for a request starts from `position` q (the position of the token the step
emitted, `next_token`); row `last_row` of the target's forward is position q - 1.
- MTP (DeepSeek-V3's convention, as vLLM runs it): the MTP layer at position t reads h_t (the
  target's final hidden state) and token t + 1 and predicts token t + 2. The first pass runs at
  every scheduled position with the next tokens (`next_ids`), writing the MTP cache, and its row
  q - 1 proposes draft 1 (for position q + 1); draft j + 1 comes from the layer again at position
  q + j - 1, fed draft j and the layer's own previous output as h. Writes up to q + K - 2.
- Draft model: the first pass runs the scheduled tokens (it only writes KV); then it is fed the
  emitted token at q, and each draft in turn: draft j + 1 from the pass at q + j. Writes up to
  q + K - 1.

DeepSeek-V4 (`V4MTPProposer`): the same MTP scheme, with V4's state. h_t is the target's final
residual streams [T, N, D] (`DeepseekV4ForCausalLM.forward_streams`, before the hyper-head), and
the layer's own output streams feed its next pass. Its block is a sliding-window layer, so its KV
is the window's K=V entries only, in a pool of the window pool's blocks `[1, num_window_blocks, B,
head_dim]` addressed by the request's window table (`ProposeSeq.window_ids`), which covers every
position its passes read or write (the window behind the step, the step, the lookahead).

Lockstep (DEP, pdmesh_engine.parallel.dep): every proposer pass crosses the MoE all-to-all, so every
rank runs the same number of passes per step, `num_passes` (a function of K and the method only):
MTP its first pass over the step's rows + K - 1 single-token passes, the draft model its pass over
the step's rows + K single-token passes. With `lockstep_scratch` set, a step whose requests stop
drafting early (their `limits`), or that has none drafting, pads with DUMMY passes (1 token at
position 0 into the scratch block, no expert load), and a rank without work runs `dummy_step`.
Passes of one method run the same MoE layers in the same order, so padding at the end of a step
keeps every rank's collective sequence aligned.

Expert load: the draft model's MoE layers record the tokens routed to their slots in the
proposer's own `ExpertLoadRecorder` (`expert_load`; one row per engine step, an empty row for a
dummy step), apart from the target's ring, so EPLB can balance the two models separately. The MTP
layer records none.

Legend: T tokens of the step, B proposing requests, V vocabulary, D hidden size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdmesh_engine.config import ModelConfig
from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.model.deepseek_v3.model import DeepseekV3ForCausalLM
from pdmesh_engine.model.deepseek_v4.model import DeepseekV4ForCausalLM
from pdmesh_engine.model.moe import ExpertLoadRecorder

# (logits [B', V] of the proposing requests `seq_indices`, draft index j) -> one token id each
ChooseFn = Callable[[torch.Tensor, list[int], int], list[int]]


@dataclass(frozen=True, slots=True)
class ProposeSeq:
    """One request whose step sampled: where its drafting starts."""

    last_row: int  # the target forward's row at position - 1 (the last verified input)
    next_token: int  # the token the step emitted (at `position`)
    position: int
    block_ids: list[int]
    max_position: int  # the last position its blocks cover: nothing is written past it
    window_ids: list[int] | None = None  # its window table (V4's window pool); None: one table


def check_draft(target_dir: Path, target: ModelConfig, draft_dir: Path, draft: ModelConfig) -> None:
    """ValueError unless the draft checkpoint shares the target's vocabulary and tokenizer size."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model {draft_dir} has vocab_size {draft.vocab_size}, the target "
            f"{target.vocab_size}: a draft must share the target's tokenizer"
        )
    if (target_dir / "tokenizer.json").is_file() and (draft_dir / "tokenizer.json").is_file():
        from pdmesh_engine.tokenizer import Tokenizer

        sizes = (
            Tokenizer.from_dir(target_dir).vocab_size,
            Tokenizer.from_dir(draft_dir).vocab_size,
        )
        if sizes[0] != sizes[1]:
            raise ValueError(
                f"draft model {draft_dir} has a tokenizer of {sizes[1]} tokens, the target "
                f"{sizes[0]}: a draft must share the target's tokenizer"
            )


class Proposer(ABC):
    """Proposes up to K drafts per sampling request, with its own paged KV cache."""

    num_lookahead_tokens: int  # positions past a step's tokens it writes when drafting

    def __init__(self, k: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k, self.dtype, self.device = k, dtype, device
        self.kv_caches = torch.empty(0, dtype=dtype, device=device)
        # DEP: the block a dummy pass writes into (set by the engine); None: no padding
        self.lockstep_scratch: int | None = None
        self.expert_load: ExpertLoadRecorder | None = None  # its own MoE layers' loads, if any

    @property
    @abstractmethod
    def num_passes(self) -> int:
        """Forward passes per step under lockstep (module docstring)."""

    @abstractmethod
    def _dummy_pass(self, batch: ForwardBatch) -> None:
        """One pass of `batch` (one token into the scratch block) that records no expert load."""

    @abstractmethod
    def _propose(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        seqs: list[ProposeSeq],
        choose: ChooseFn,
    ) -> tuple[list[list[int]], int]:
        """(each seq's drafts, forward passes run)."""

    @property
    @abstractmethod
    def kv_shape(self) -> tuple[int, int]:
        """(layers, entry width) of its cache."""

    def kv_bytes_per_block(self, block_size: int) -> int:
        layers, width = self.kv_shape
        return layers * block_size * width * torch.tensor([], dtype=self.dtype).element_size()

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """Its cache [layers, num_blocks, block_size, entry], zeroed (same block ids as the
        target's)."""
        layers, width = self.kv_shape
        self.kv_caches = torch.zeros(
            (layers, num_blocks, block_size, width), dtype=self.dtype, device=self.device
        )

    def propose(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor,  # [T, D] the target's forward output
        next_ids: torch.Tensor,  # [T] token t + 1 for each row at position t
        seqs: list[ProposeSeq],
        choose: ChooseFn,
    ) -> list[list[int]]:
        """Write its KV for the batch's positions and return each seq's drafts (at most K, fewer
        where `max_position` leaves no room). Under lockstep the step's passes are padded to
        `num_passes` with dummy passes."""
        drafts, passes = self._propose(batch, hidden, next_ids, seqs, choose)
        if self.lockstep_scratch is not None:
            self._dummy_passes(self.num_passes - passes)
        if self.expert_load is not None:
            self.expert_load.end_step()
        return drafts

    def dummy_step(self) -> None:
        """A lockstep step without work on this rank: `num_passes` dummy passes, an empty load
        row."""
        self._dummy_passes(self.num_passes)
        if self.expert_load is not None:
            self.expert_load.end_step()

    def _dummy_passes(self, count: int) -> None:
        if count <= 0:
            return
        if self.lockstep_scratch is None:
            raise RuntimeError("dummy proposer passes need lockstep_scratch (a DEP engine)")
        batch = ForwardBatch.build(
            [[0]], [0], [[self.lockstep_scratch]], self.kv_caches.shape[2], [False], self.device
        )
        for _ in range(count):
            self._dummy_pass(batch)

    def _single_tokens(
        self, token_ids: list[int], positions: list[int], seqs: list[ProposeSeq]
    ) -> ForwardBatch:
        windows = [s.window_ids for s in seqs if s.window_ids is not None]
        return ForwardBatch.build(
            [[t] for t in token_ids],
            positions,
            [s.block_ids for s in seqs],
            self.kv_caches.shape[2],
            [False] * len(seqs),
            self.device,
            windows if len(windows) == len(seqs) else None,
        )


class MTPProposer(Proposer):
    """The target checkpoint's first MTP layer drafts (module docstring)."""

    def __init__(
        self,
        model: DeepseekV3ForCausalLM | DeepseekV4ForCausalLM,
        k: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if not len(model.mtp):
            raise ValueError(
                "speculative_method 'mtp' needs a checkpoint with an MTP layer "
                "(num_nextn_predict_layers > 0 and its weights); this one has none"
            )
        super().__init__(k, dtype, device)
        self.model = model
        self.num_lookahead_tokens = k - 1

    @property
    def kv_shape(self) -> tuple[int, int]:
        return 1, self.model.config.kv_cache_dim  # type: ignore[union-attr]

    @property
    def num_passes(self) -> int:
        return self.k

    def _dummy_pass(self, batch: ForwardBatch) -> None:
        hidden = torch.zeros(1, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
        self.model.forward_mtp(batch.input_ids, hidden, batch, self.kv_caches)

    def _propose(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        seqs: list[ProposeSeq],
        choose: ChooseFn,
    ) -> tuple[list[list[int]], int]:
        x = self.model.forward_mtp(next_ids, hidden, batch, self.kv_caches)  # [T, D]
        passes = 1
        if not seqs:
            return [], passes
        rows = torch.tensor([s.last_row for s in seqs], device=x.device)
        x = x.index_select(0, rows)  # [B, D], row b: seqs[b]
        active = list(range(len(seqs)))
        drafts = [[t] for t in choose(self.model.compute_mtp_logits(x), active, 0)]
        limits = [min(self.k, s.max_position - s.position + 2) for s in seqs]
        for j in range(1, self.k):
            keep = [i for i, b in enumerate(active) if limits[b] > j]
            if not keep:
                break
            if len(keep) < len(active):
                x = x.index_select(0, torch.tensor(keep, device=x.device))
                active = [active[i] for i in keep]
            sub = [seqs[b] for b in active]
            step = self._single_tokens(
                [drafts[b][-1] for b in active], [s.position + j - 1 for s in sub], sub
            )
            x = self.model.forward_mtp(step.input_ids, x, step, self.kv_caches)
            passes += 1
            for b, token in zip(
                active, choose(self.model.compute_mtp_logits(x), active, j), strict=True
            ):
                drafts[b].append(token)
        return drafts, passes


class V4MTPProposer(MTPProposer):
    """DeepSeek-V4's MTP layer drafts (module docstring): `hidden` is the target's final streams
    [T, N, D], and its cache is allocated with the window pool's block count
    (`allocate_kv(num_window_blocks, block_size)`), one K=V entry of `head_dim` per token."""

    model: DeepseekV4ForCausalLM

    @property
    def kv_shape(self) -> tuple[int, int]:
        return 1, self.model.config.head_dim

    def _dummy_pass(self, batch: ForwardBatch) -> None:
        """Nothing: the MTP layer holds every one of its experts on each rank (no all-to-all), so
        under DEP its passes have no partner to keep in step with."""


class DraftModelProposer(Proposer):
    """A separate, smaller checkpoint with the target's tokenizer drafts (module docstring)."""

    def __init__(
        self, model: DeepseekV3ForCausalLM, k: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(k, dtype, device)
        self.model = model
        self.num_lookahead_tokens = k

    @property
    def kv_shape(self) -> tuple[int, int]:
        return self.model.config.num_hidden_layers, self.model.config.kv_cache_dim

    @property
    def num_passes(self) -> int:
        return self.k + 1

    def _dummy_pass(self, batch: ForwardBatch) -> None:
        self.model(batch, self.kv_caches)

    def _propose(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        seqs: list[ProposeSeq],
        choose: ChooseFn,
    ) -> tuple[list[list[int]], int]:
        # its KV at the step's positions; the output is unused
        self.model(batch, self.kv_caches, self.expert_load)
        passes = 1
        drafts: list[list[int]] = [[] for _ in seqs]
        limits = [min(self.k, s.max_position - s.position + 1) for s in seqs]
        feed = [s.next_token for s in seqs]
        for j in range(self.k):
            active = [b for b in range(len(seqs)) if limits[b] > j]
            if not active:
                break
            sub = [seqs[b] for b in active]
            step = self._single_tokens(
                [feed[b] for b in active], [s.position + j for s in sub], sub
            )
            logits = self.model.compute_logits(self.model(step, self.kv_caches, self.expert_load))
            passes += 1
            for b, token in zip(active, choose(logits, active, j), strict=True):
                drafts[b].append(token)
                feed[b] = token
        return drafts, passes
