"""`EngineCore`: one engine instance, token ids in, token ids out. The step is schedule → execute →
update.

Expert placement (EPLB): `stage_placement` stages a new placement of the decoder's MoE layers in the
background (pdmesh_engine.parallel.placement); `step()` switches to it at a step boundary: a
single-rank engine at the first step after staging finished, a DEP rank in the step where every rank
has it ready (agreed through the per-step DP sync, pdmesh_engine.parallel.dep). Greedy outputs do
not change: a placement only decides which slot computes an expert.

Speculative decoding (`EngineConfig.speculative_method`): the scheduler schedules drafts, the
runner verifies and proposes (`ModelRunner.execute_spec`), and a step may emit several tokens per
request; `spec_decode_stats()` (also on `status()`) says how many drafts were accepted. A DEP rank
speculates too: every rank runs the proposer's passes in each step, padded with dummy passes
(pdmesh_engine.parallel.dep); a draft model's routed experts are split across the ranks on a
placement of their own. A draft model with MoE layers is balanced on its own ("draft" in
`expert_models`, beside "target"): its own load ring (`expert_load_window("draft")`), its own
placement versions (`stage_placement(..., model="draft")`), switched like the target's.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdmesh_engine.config import EngineConfig
from pdmesh_engine.grammar import GrammarCompiler
from pdmesh_engine.kv_cache import KVCacheStats
from pdmesh_engine.kv_window import WindowedKVManager
from pdmesh_engine.model.registry import read_model_config
from pdmesh_engine.model_runner import ModelRunner
from pdmesh_engine.parallel.dep import DEPContext, LockstepStepper
from pdmesh_engine.parallel.placement import (
    CheckpointTensors,
    ExpertModel,
    PlacementStager,
    StagingStats,
)
from pdmesh_engine.request import Request, RequestStatus
from pdmesh_engine.sampling import SamplingParams, check_prompt
from pdmesh_engine.scheduler import (
    SampledToken,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SpecTokens,
    StepOutput,
)
from pdmesh_engine.spec_decode import SpecDecodeCounter, SpecDecodeStats
from pdmesh_engine.spec_proposer import DraftModelProposer

# the models of an engine whose routed experts EPLB balances (`EngineCore.expert_models`)
TARGET, DRAFT = "target", "draft"

if TYPE_CHECKING:
    import torch

    from pdmesh_engine.model.deepseek_v3.runtime import KVLayout
    from pdmesh_engine.model.moe import ExpertLoadRecorder
    from pdmesh_engine.transfer.layout import KVMemory


@dataclass(frozen=True)
class CoreStatus:
    """The engine at one moment (see `EngineCore.status`)."""

    num_running: int  # requests in the running batch
    num_waiting: int  # requests waiting to run or waiting for KV from elsewhere
    kv: KVCacheStats
    # routed-expert weights this rank holds (about 1/dp_size of them under DEP)
    expert_weight_bytes: int
    spec_decode: SpecDecodeStats | None = None  # None: speculative decoding is off


class EngineCore:
    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        dep: DEPContext | None = None,
    ) -> None:
        """`dep`: this engine is one rank of a DEP instance (see pdmesh_engine.parallel.dep); step()
        is collective."""
        self.config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.model_config = read_model_config(model_dir)
        self.runner = ModelRunner(
            model_dir,
            self.model_config,
            self.config,
            model_kwargs=dep.model_kwargs(self.model_config) if dep else None,
            draft_model_kwargs=dep.draft_model_kwargs if dep else None,
            reserve_scratch=dep is not None,
        )
        self.config = self.runner.config  # with the model's defaults (block size)
        layout = self.runner.kv_layout
        # the last block may be the scratch of DEP's dummy forwards and of CUDA-graph padding
        scratch = self.runner.scratch_block
        num_blocks = layout.num_blocks if scratch is None else scratch
        self.kv = self.runner.family.make_kv_manager(
            layout,
            num_blocks,
            self.config.enable_prefix_caching,
            # the MTP layer's KV at t depends on token t + 1 (KVCacheManager docstring)
            recompute_last_hit=self.config.speculative_method == "mtp",
        )
        if isinstance(self.kv, WindowedKVManager):
            self.runner.window_tables = self.kv.window_table
        self.max_model_len = self.config.context_limit(
            self.model_config, num_blocks * layout.block_size
        )
        self.stager = PlacementStager(
            self.runner.model, CheckpointTensors(model_dir), self.runner.expert_load
        )
        # the models whose experts EPLB balances: the target, and a draft model with MoE layers
        self.expert_models = {
            TARGET: ExpertModel(
                self.runner.model,
                self.runner.expert_load,
                self.stager,
                self.config.expert_load_window,
            )
        }
        draft = self.runner.proposer
        if isinstance(draft, DraftModelProposer) and draft.expert_load is not None:
            self.expert_models[DRAFT] = ExpertModel(
                draft.model,
                draft.expert_load,
                PlacementStager(
                    draft.model, CheckpointTensors(self.config.draft_model or ""), draft.expert_load
                ),
                self.config.expert_load_window,
            )
        self.lockstep: LockstepStepper | None = None
        if dep is not None:
            assert scratch is not None  # reserved for DEP
            if self.runner.proposer is not None:  # its dummy passes share the scratch block
                self.runner.proposer.lockstep_scratch = scratch
            self.lockstep = LockstepStepper(
                dep.dp_sync,
                self.runner,
                scratch_block=scratch,
                placement=self.stager,
                size=dep.config.size,
                draft_placement=self.draft_stager,
            )
        self.dep = dep
        if dep is not None and dep.elastic is not None and self.lockstep is not None:
            self.lockstep.join_pending = dep.elastic.join_pending
            self.lockstep.recover = self._recover
        proposer = self.runner.proposer
        self.scheduler = Scheduler(
            SchedulerConfig(
                self.config.max_num_seqs,
                self.config.max_num_batched_tokens,
                self.max_model_len,
                self.config.max_kv_loads_per_step,
                self.config.num_spec_tokens,
                proposer.num_lookahead_tokens if proposer is not None else 0,
            ),
            self.kv,
        )
        self.spec_counter = (
            SpecDecodeCounter(self.config.num_spec_tokens) if self.config.num_spec_tokens else None
        )
        self._ids = itertools.count()

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        hold_blocks: bool = False,
    ) -> str:
        """Queue a request; raises ValueError for an empty or too long prompt or a bad token id.

        With `hold_blocks` the KV blocks stay allocated after the request finishes, until
        `release_held()` (a prefill instance pushes them to decode first).
        """
        request = self._make_request(prompt_token_ids, params, request_id)
        request.hold_blocks = hold_blocks
        self.scheduler.add_request(request)
        return request.request_id

    def reserve(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> dict[str, list[int]] | None:
        """Hold blocks for a prompt whose KV another instance computes: its block tables by KV
        group (`kv_tables`); None if the pool is short."""
        request = self._make_request(prompt_token_ids, params, request_id)
        if self.scheduler.reserve(request) is None:
            return None
        return self.kv_tables(request_id)

    def kv_arrived(self, request_id: str, first_token_id: int | None = None) -> StepOutput | None:
        """The reserved blocks hold the prompt's KV: decode from the first token on (see
        Scheduler)."""
        return self.scheduler.kv_arrived(request_id, first_token_id)

    def blocks_of(self, request_id: str) -> list[int]:
        return self.kv.blocks_of(request_id)

    def release_held(self, request_id: str) -> bool:
        return self.scheduler.release_held(request_id)

    def _make_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None
    ) -> Request:
        check_prompt(
            prompt_token_ids,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
        )
        params.validate_for_vocab(self.model_config.vocab_size)
        request = Request(
            request_id or f"req-{next(self._ids)}",
            list(prompt_token_ids),
            params,
            eos_token_ids=self.model_config.eos_token_ids,
        )
        if params.grammar_kind is not None:
            prior = params.prior_output_tokens  # a migrated request's tokens end its prompt
            replay = prompt_token_ids[len(prompt_token_ids) - prior :] if prior else ()
            request.grammar = self.grammars.start(params.grammar_kind, params.grammar, replay)
        return request

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """The structured-output grammars on this model's tokenizer (made at the first request
        with a grammar)."""
        return GrammarCompiler.from_model_dir(
            self.model_dir, self.model_config.vocab_size, self.model_config.eos_token_ids
        )

    def step(self) -> list[StepOutput]:
        if self.lockstep is None:  # single rank: a ready placement is switched in before scheduling
            for expert_model in self.expert_models.values():
                ready = expert_model.stager.ready_version()
                if ready:
                    expert_model.stager.switch_to(ready)
        output = self.scheduler.schedule()
        if self.lockstep is not None:  # DEP: DP sync, then the batch, a dummy forward or nothing
            pending = self.scheduler.num_running + len(self.scheduler.waiting)
            sampled = self.lockstep.execute(output, self.scheduler.requests, pending)
            if self.spec_counter is not None:
                self._count_spec(sampled.values(), self.spec_counter)
            outputs = self.scheduler.update_from_output(output, sampled)
            record = self.lockstep.last
            if record is not None and record.regroup:  # a rank joins: every member, this step
                self.reform()
            return outputs
        elif self.spec_counter is not None:
            return self._spec_step(output, self.spec_counter)
        else:
            sampled = self.runner.execute(output, self.scheduler.requests)
        return self.scheduler.update_from_output(output, sampled)

    def _recover(self) -> None:
        """Elastic DEP, a collective failed: abort this rank's groups (its peers fail at once),
        then re-form without the lost rank."""
        if self.dep is not None and self.dep.elastic is not None:
            self.dep.elastic.abort()
        self.reform(failed=True)

    def reform(self, failed: bool = False) -> None:
        """Elastic DEP: re-form the group (next epoch) and re-split the experts over its members
        (pdmesh_engine.parallel.elastic). Collective over the new members."""
        dep = self.dep
        if dep is None or dep.elastic is None or self.lockstep is None:
            raise ValueError("reform needs an elastic DEP rank")
        dep.elastic.reform(self.expert_models, dep.config.num_redundant_experts, failed)
        self.lockstep.rebind(dep.dp_sync, dep.elastic.size)

    @property
    def draft_stager(self) -> PlacementStager | None:
        """The draft model's placement stager (None without a draft model with MoE layers)."""
        draft = self.expert_models.get(DRAFT)
        return draft.stager if draft is not None else None

    def _spec_step(self, output: SchedulerOutput, counter: SpecDecodeCounter) -> list[StepOutput]:
        verified: dict[str, SpecTokens] = self.runner.execute_spec(output, self.scheduler.requests)
        self._count_spec(verified.values(), counter)
        return self.scheduler.update_from_output(output, verified)

    @staticmethod
    def _count_spec(
        results: Iterable[SampledToken | SpecTokens], counter: SpecDecodeCounter
    ) -> None:
        for spec in results:
            if isinstance(spec, SpecTokens):
                counter.record(spec.num_draft_tokens, spec.num_accepted)

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Draft acceptance since start (`SpecDecodeStats`); None with speculation off."""
        return self.spec_counter.stats() if self.spec_counter is not None else None

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    # ----- expert placement (EPLB) -----
    @property
    def placement_version(self) -> int:
        """The target placement running now (0: the checkpoint's initial one)."""
        return self.stager.running_version

    @property
    def staged_version(self) -> int:
        """The target placement staged and ready to switch to (= `placement_version` when none
        is)."""
        return self.stager.staged_version

    @property
    def last_staging(self) -> StagingStats | None:
        """What staging the last finished version cost (slots changed, copied, read, bytes,
        seconds)."""
        return self.stager.last_stats

    def stage_placement(
        self,
        version: int,
        physical_to_logical: Sequence[Sequence[int]],
        model: str = TARGET,
    ) -> bool:
        """Stage `physical_to_logical` ([L][P], one row per decoder MoE layer of `model`: "target"
        or "draft", see `expert_models`) as `version` in a background thread and return at once;
        False if the version is not newer than the running/staged/staging one or the shape does
        not fit. `step()` switches to it (module docstring)."""
        return self.expert_models[model].stager.request(version, physical_to_logical)

    def expert_load_steps(self, model: str = TARGET) -> tuple[int, int]:
        """(forward steps recorded since start, that count when the running placement was switched
        in) of `model`'s load ring."""
        return self.expert_models[model].load_steps()

    @property
    def bytes_per_expert(self) -> int:
        """Bytes of one routed expert's weights (w13 + w2 of one slot); 0 without MoE layers."""
        return self.expert_models[TARGET].bytes_per_expert

    def expert_load_window(self, model: str = TARGET) -> tuple[int, int, list[list[int]]]:
        """(steps recorded since the last switch, capped at the window; the window; [L][P] tokens
        per slot routed by this rank over those steps) of `model` ("target", or "draft": the
        speculative draft model's own ring), with one host sync for all layers."""
        return self.expert_models[model].load_window()

    @property
    def draft_expert_load(self) -> ExpertLoadRecorder | None:
        """The draft model's own expert load ring (None: no draft model, or one without MoE)."""
        draft = self.expert_models.get(DRAFT)
        return draft.expert_load if draft is not None else None

    def finish(self, request_id: str, stop_reason: str) -> None:
        """End a request that met a stop string (found by the detokenizing front end)."""
        self.scheduler.finish(request_id, RequestStatus.FINISHED_STOPPED, stop_reason)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def kv_stats(self) -> KVCacheStats:
        return self.kv.stats()

    def status(self) -> CoreStatus:
        return CoreStatus(
            self.scheduler.num_running,
            self.scheduler.num_waiting,
            self.kv.stats(),
            self.runner.expert_weight_bytes(),
            self.spec_decode_stats(),
        )

    def request_ids(self) -> list[str]:
        """Every request this engine holds state or blocks for (queued, running, waiting for KV,
        held)."""
        return [*self.scheduler.requests, *self.scheduler.held]

    @property
    def kv_layout(self) -> KVLayout:
        return self.runner.kv_layout

    @property
    def kv_caches(self) -> torch.Tensor:
        """The KV pool, [num_layers, num_blocks, block_size, entry_dim] (what a NIXL agent
        registers)."""
        return self.runner.kv_caches

    def kv_memory(self) -> list[KVMemory]:
        """The KV groups a prompt's hand-off moves (what a NIXL agent registers): V3 `kv` (and
        `draft`, the proposer's pool, with speculative decoding), V4 `full` and `window`."""
        return self.runner.family.kv_memory(self.runner.kv_caches, self.draft_kv_caches)

    def kv_tables(self, request_id: str) -> dict[str, list[int]]:
        """A request's block tables by KV group (`kv_memory`), by logical block index."""
        tables = self.kv.block_tables(request_id)
        return {m.name: tables[m.table or m.name] for m in self.kv_memory()}

    @property
    def draft_kv_caches(self) -> torch.Tensor | None:
        """The speculative proposer's own KV pool, [layers, num_blocks, block_size, entry] on the
        same block ids as `kv_caches` (a NIXL agent registers it beside them, and a prompt's
        hand-off carries both); None with speculation off."""
        proposer = self.runner.proposer
        return proposer.kv_caches if proposer is not None else None

    @property
    def speculative(self) -> str:
        """What the proposer's KV holds, as prefill and decode ranks compare it at a hand-off: ""
        (off), "mtp", or "draft_model:<draft model directory name>". K is left out: it changes
        how far a step drafts, not the KV of the prompt."""
        method = self.config.speculative_method if self.config.num_spec_tokens else None
        if method == "draft_model":
            return f"draft_model:{Path(self.config.draft_model or '').resolve().name}"
        return method or ""
