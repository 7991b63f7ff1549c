"""`SpecDecoder`: one engine step with speculative decoding (the model runner's `execute_spec`).

    SchedulerOutput → ForwardBatch (each verify request split into 1 + k one-token rows) → target
    forward → logits at every sampling row → acceptance (`spec_decode`) → the proposer's KV pass
    and drafts → {request_id: SpecTokens}

A request verifying k drafts runs its last token and the drafts in the same forward; each of its
1 + k tokens is laid out as a one-token decode row at its own position with the request's block
table (row i's context ends at its own position, the drafts' KV is written before attention reads
it), so a verify row computes exactly what a plain decode of that token at that position computes,
and greedy output equals speculation off. Logits come from every verify row; a chunk (prefill or
recomputation) is one row group and samples at its last row only, as `execute` does.

Rejected drafts are not rewound: the state their rows wrote is recomputed before anything reads
it. Every piece of per-step state is indexed by position: V3's KV, and DeepSeek-V4's window K=V
entries, compressor rows and compressed entries (CSA's KV and indexer keys, HCA's KV; an entry is
pooled, from the rows of its window, by the row at the window's last position, and is visible only
to queries at or past that position). A query at position p reads only state of positions <= p,
each layer writes all of a step's state before any row reads it, and the next step starts at the
first unverified position, so a position at or past the first rejected draft is computed again,
with the right token, in the step that next reaches it, ahead of any row that reads it: an entry a
rejected draft closed is pooled again by the row that closes its window next, from rows rewritten
by then. Committing only accepted positions would need a second pass or a snapshot of the open
windows per step; recomputation costs nothing beyond the verify forward itself. Only verified
positions are hashed for prefix caching, so a cached block never holds a rejected draft's state.

Structured outputs: a verify row's target distribution is masked by what the request's grammar
allows after the drafts before it (`_masks`), so a draft the grammar forbids is rejected and the
emitted tokens are those of decoding without speculation; drafts are proposed unconstrained.

Filters (bans, temperature, min-p, top-k, top-p) are applied to the target's distributions p and to
the draft's distributions q alike; q of a sampled (non-greedy) request's drafts is kept here, by
request id, until its next step verifies them, and dropped when the request ends.
Seeded requests draw from their generator: per step k uniforms and one [V] vector for the
verification, one [V] vector per sampled draft, so a seeded request repeats run to run.

Legend: T tokens of the step, R logit rows, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pdmesh_engine.config import EngineConfig, ModelConfig
from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.grammar import masks_beside
from pdmesh_engine.model.deepseek_v3.model import DeepseekV3ForCausalLM
from pdmesh_engine.model.deepseek_v4.kv import V4Cache
from pdmesh_engine.model.deepseek_v4.model import DeepseekV4ForCausalLM
from pdmesh_engine.model.moe import ExpertLoadRecorder
from pdmesh_engine.request import Request
from pdmesh_engine.sampler import Sampler, banned_argmax, filtered_probs, with_logprobs
from pdmesh_engine.scheduler import SampledToken, ScheduledRequest, SchedulerOutput, SpecTokens
from pdmesh_engine.spec_decode import greedy_accept, rejection_sample
from pdmesh_engine.spec_proposer import Proposer, ProposeSeq


class TargetRunner(Protocol):
    """What verification reads of the runner that owns the target model (`ModelRunner`)."""

    config: EngineConfig
    model_config: ModelConfig
    device: torch.device
    model: DeepseekV3ForCausalLM | DeepseekV4ForCausalLM
    kv_caches: torch.Tensor | V4Cache  # V3's paged pool, V4's pools
    expert_load: ExpertLoadRecorder | None
    sampler: Sampler
    window_tables: Callable[[str], list[int]] | None  # V4: a request's window table

    def generator_for(self, request: Request) -> torch.Generator | None: ...


@dataclass(slots=True)
class _Item:
    """A scheduled request and where its tokens sit in the step's forward."""

    scheduled: ScheduledRequest
    request: Request
    first_row: int  # row of scheduled.token_ids[0]

    @property
    def num_rows(self) -> int:
        return len(self.scheduled.token_ids)

    @property
    def num_drafts(self) -> int:
        return self.scheduled.num_draft_tokens

    @property
    def first_sample_row(self) -> int:
        """Row whose logits give the first token the step may emit (then one row per draft)."""
        return self.first_row + self.num_rows - 1 - self.num_drafts


@dataclass(slots=True)
class _Verdict:
    tokens: list[SampledToken]  # emitted: accepted drafts, then the target's token
    num_accepted: int


class SpecDecoder:
    def __init__(self, runner: TargetRunner, proposer: Proposer, k: int) -> None:
        self.runner, self.proposer, self.k = runner, proposer, k
        # non-greedy requests' draft distributions [n, V] for the drafts they will verify next
        self.draft_probs: dict[str, torch.Tensor] = {}

    def end_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.draft_probs.pop(request_id, None)

    def execute(
        self, output: SchedulerOutput, requests: dict[str, Request]
    ) -> dict[str, SpecTokens]:
        runner = self.runner
        items, batch = self._build(output.scheduled, requests)
        sampling = [item for item in items if item.scheduled.needs_sample]
        masks = self._masks(sampling)
        hidden, states = self._forward(batch)
        if runner.expert_load is not None:
            runner.expert_load.end_step()
        verdicts = self._verify(hidden, sampling, masks) if sampling else []
        next_ids = self._next_ids(items, dict(zip(map(id, sampling), verdicts, strict=True)))
        seqs = [self._propose_seq(item, v) for item, v in zip(sampling, verdicts, strict=True)]
        emitted = [len(v.tokens) for v in verdicts]
        q_rows: list[list[torch.Tensor]] = [[] for _ in sampling]

        def choose(logits: torch.Tensor, seq_indices: list[int], j: int) -> list[int]:
            return self._choose(
                logits, [sampling[b] for b in seq_indices], seq_indices, j, emitted, q_rows
            )

        drafts = self.proposer.propose(batch, states, next_ids, seqs, choose)
        result: dict[str, SpecTokens] = {}
        for item, verdict, item_drafts, rows in zip(
            sampling, verdicts, drafts, q_rows, strict=True
        ):
            request_id = item.request.request_id
            if rows:
                self.draft_probs[request_id] = torch.stack(rows)
            else:
                self.draft_probs.pop(request_id, None)
            result[request_id] = SpecTokens(
                tuple(verdict.tokens), item.num_drafts, verdict.num_accepted, tuple(item_drafts)
            )
        return result

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's forward: (hidden [T, D], what the proposer reads of it): V3 the hidden
        states both; V4 its final residual streams [T, N, D] (the MTP layer's input)."""
        runner, model = self.runner, self.runner.model
        if isinstance(model, DeepseekV4ForCausalLM):
            assert isinstance(runner.kv_caches, V4Cache)
            streams = model.forward_streams(batch, runner.kv_caches, runner.expert_load)
            return model.final_hidden(streams), streams
        hidden = model(batch, runner.kv_caches, runner.expert_load)
        return hidden, hidden

    def _build(
        self, scheduled: list[ScheduledRequest], requests: dict[str, Request]
    ) -> tuple[list[_Item], ForwardBatch]:
        """One-token rows first (decodes and each verify request's 1 + k tokens), then chunks."""
        singles = [s for s in scheduled if len(s.token_ids) == 1 or s.num_draft_tokens]
        chunks = [s for s in scheduled if len(s.token_ids) > 1 and not s.num_draft_tokens]
        token_ids: list[list[int]] = []
        starts: list[int] = []
        blocks: list[list[int]] = []
        windows: list[list[int]] = []
        tables = self.runner.window_tables
        items: list[_Item] = []
        for s in singles:
            items.append(_Item(s, requests[s.request_id], len(starts)))
            for i, token in enumerate(s.token_ids):
                token_ids.append([token])
                starts.append(s.start_position + i)
                blocks.append(s.block_ids)
                if tables is not None:
                    windows.append(tables(s.request_id))
        row = len(starts)
        for s in chunks:
            items.append(_Item(s, requests[s.request_id], row))
            token_ids.append(s.token_ids)
            starts.append(s.start_position)
            blocks.append(s.block_ids)
            if tables is not None:
                windows.append(tables(s.request_id))
            row += len(s.token_ids)
        batch = ForwardBatch.build(
            token_ids,
            starts,
            blocks,
            self.runner.config.block_size,
            [False] * len(starts),
            self.runner.device,
            windows if tables is not None else None,
        )
        return items, batch

    def _masks(self, sampling: list[_Item]) -> Future[np.ndarray] | None:
        """The grammar masks of the verify rows (`_verify`'s order: 1 + k rows an item), started
        beside the forward: row i of an item is what its grammar allows after its first i drafts
        (a draft the grammar forbids is then never accepted)."""
        rows, offset = [], 0
        for item in sampling:
            drafts = item.scheduled.token_ids[len(item.scheduled.token_ids) - item.num_drafts :]
            rows.append((item.request.grammar, offset, drafts))
            offset += item.num_drafts + 1
        return masks_beside(rows, offset, self.runner.model_config.vocab_size)

    def _verify(
        self, hidden: torch.Tensor, sampling: list[_Item], masks: Future[np.ndarray] | None
    ) -> list[_Verdict]:
        """Each sampling item's emitted tokens: greedy items by `greedy_accept`, sampled ones by
        `rejection_sample` against the draft distributions kept from their previous step. Row i
        of an item (the token after its i-th draft) bans what the i-th next output must not be,
        and what its grammar forbids there."""
        offsets, rows, bans = [], [], []
        for item in sampling:
            offsets.append(len(rows))
            rows.extend(range(item.first_sample_row, item.first_sample_row + item.num_drafts + 1))
            bans.extend(item.request.banned_token_ids(i) for i in range(item.num_drafts + 1))
        logits = self.runner.model.compute_logits(
            hidden.index_select(0, torch.tensor(rows, device=hidden.device))
        )  # [R, V]
        spans = [
            range(o, o + item.num_drafts + 1) for o, item in zip(offsets, sampling, strict=True)
        ]
        is_greedy = [item.request.sampling_params.is_greedy for item in sampling]
        greedy_rows = [r for b, span in enumerate(spans) if is_greedy[b] for r in span]
        sampled_rows = [r for b, span in enumerate(spans) if not is_greedy[b] for r in span]
        allowed = torch.from_numpy(masks.result()).to(logits.device) if masks is not None else None
        argmax: dict[int, int] = {}
        if greedy_rows:
            ids = banned_argmax(
                self._select(logits, greedy_rows),
                [bans[r] for r in greedy_rows],
                self._select(allowed, greedy_rows) if allowed is not None else None,
            )
            argmax = dict(zip(greedy_rows, ids.tolist(), strict=True))
        probs = torch.empty(0)
        if sampled_rows:
            probs = filtered_probs(  # [rows of sampled items, V]
                self._select(logits, sampled_rows),
                [
                    sampling[b].request.sampling_params
                    for b in range(len(sampling))
                    if not is_greedy[b]
                    for _ in spans[b]
                ],
                [bans[r] for r in sampled_rows],
                self._select(allowed, sampled_rows) if allowed is not None else None,
            )
        outcomes: list[tuple[list[int], int]] = []
        first_prob_row = 0
        for b, item in enumerate(sampling):
            drafts = item.scheduled.token_ids[len(item.scheduled.token_ids) - item.num_drafts :]
            if is_greedy[b]:
                outcomes.append(greedy_accept(drafts, [argmax[r] for r in spans[b]]))
                continue
            p = probs[first_prob_row : first_prob_row + len(spans[b])]
            first_prob_row += len(spans[b])
            outcomes.append(self._rejection_sample(item, drafts, p))
        return self._with_logprobs(logits, sampling, offsets, outcomes)

    @staticmethod
    def _select(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return x.index_select(0, torch.tensor(rows, device=x.device))

    def _rejection_sample(
        self, item: _Item, drafts: list[int], p: torch.Tensor
    ) -> tuple[list[int], int]:
        """`rejection_sample` of a sampled request with the q it kept for these drafts."""
        request_id = item.request.request_id
        q = self.draft_probs.get(request_id)
        if q is None or q.shape[0] < len(drafts):
            if drafts:
                raise RuntimeError(f"no draft distribution kept for request {request_id}")
            q = p[:0]
        generator = self.runner.generator_for(item.request)
        if generator is None:
            generator = self.runner.sampler.default_generator(self.runner.device)
        return rejection_sample(drafts, p, q[: len(drafts)], generator)

    def _with_logprobs(
        self,
        logits: torch.Tensor,
        sampling: list[_Item],
        offsets: list[int],
        outcomes: list[tuple[list[int], int]],
    ) -> list[_Verdict]:
        """Verdicts; the raw logprobs of each emitted token (its own row's) where asked for."""
        wanting = [
            b
            for b, item in enumerate(sampling)
            if item.request.sampling_params.logprobs is not None
        ]
        verdicts = [_Verdict([SampledToken(t) for t in tokens], a) for tokens, a in outcomes]
        if not wanting:
            return verdicts
        rows = [offsets[b] + i for b in wanting for i in range(len(outcomes[b][0]))]
        tokens = [t for b in wanting for t in outcomes[b][0]]
        params = [sampling[b].request.sampling_params for b in wanting for _ in outcomes[b][0]]
        device = logits.device
        result = with_logprobs(
            logits.index_select(0, torch.tensor(rows, device=device)),
            torch.tensor(tokens, device=device),
            params,
        )
        chosen = result.logprobs.tolist() if result.logprobs is not None else []
        top_ids = result.top_ids.tolist() if result.top_ids is not None else []
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else []
        row = 0
        for b in wanting:
            wanted = sampling[b].request.sampling_params.logprobs or 0
            sampled_tokens = []
            for token in outcomes[b][0]:
                top = tuple(zip(top_ids[row][:wanted], top_lps[row][:wanted], strict=True))
                sampled_tokens.append(SampledToken(token, chosen[row], top))
                row += 1
            verdicts[b].tokens = sampled_tokens
        return verdicts

    def _next_ids(self, items: list[_Item], verdicts: dict[int, _Verdict]) -> torch.Tensor:
        """[T] the token after each row's token: the next scheduled one, the request's next known
        token after a chunk that does not sample, and the emitted token at the last verified row
        (rows past it are rejected drafts: their proposer KV is rewritten later)."""
        next_ids: list[int] = []
        for item in items:
            ids = item.scheduled.token_ids
            verdict = verdicts.get(id(item))
            if verdict is None:
                end = item.scheduled.start_position + len(ids)
                next_ids.extend([*ids[1:], item.request.all_token_ids[end]])
                continue
            shifted = [*ids[1:], verdict.tokens[-1].token_id]
            shifted[len(ids) - 1 - item.num_drafts + verdict.num_accepted] = verdict.tokens[
                -1
            ].token_id
            next_ids.extend(shifted)
        return torch.tensor(next_ids, device=self.runner.device)

    def _propose_seq(self, item: _Item, verdict: _Verdict) -> ProposeSeq:
        s = item.scheduled
        last = len(s.token_ids) - 1 - item.num_drafts + verdict.num_accepted  # last verified input
        tables = self.runner.window_tables
        return ProposeSeq(
            item.first_row + last,
            verdict.tokens[-1].token_id,
            s.start_position + last + 1,
            s.block_ids,
            s.start_position + len(s.token_ids) - 1 + s.num_lookahead_tokens,
            tables(s.request_id) if tables is not None else None,
        )

    def _choose(
        self,
        logits: torch.Tensor,  # [B', V] draft logits of `items`
        items: list[_Item],
        seq_indices: list[int],
        j: int,
        emitted: list[int],
        q_rows: list[list[torch.Tensor]],
    ) -> list[int]:
        """Draft j of each item: greedy requests take the banned argmax; sampled ones draw from
        their filtered draft distribution q (kept in `q_rows` for the next verification)."""
        bans = [
            it.request.banned_token_ids(emitted[b] + j)
            for it, b in zip(items, seq_indices, strict=True)
        ]
        tokens = banned_argmax(logits, bans)
        sampled = [i for i, it in enumerate(items) if not it.request.sampling_params.is_greedy]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            probs = filtered_probs(
                logits.index_select(0, index),
                [items[i].request.sampling_params for i in sampled],
                [bans[i] for i in sampled],
            )
            generators = [self.runner.generator_for(items[i].request) for i in sampled]
            tokens[index] = self.runner.sampler.sample_probs(probs, generators)
            for row, i in enumerate(sampled):
                q_rows[seq_indices[i]].append(probs[row])
        return tokens.tolist()
