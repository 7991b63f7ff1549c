"""`EngineCore`: one engine instance, token ids in, token ids out. The step is schedule → execute → update."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdmesh_engine.config import EngineConfig, ModelConfig
from pdmesh_engine.kv_cache import KVCacheManager, KVCacheStats
from pdmesh_engine.model_runner import ModelRunner
from pdmesh_engine.parallel.dep import DEPContext, LockstepStepper
from pdmesh_engine.request import Request, RequestStatus
from pdmesh_engine.sampling import SamplingParams, check_prompt
from pdmesh_engine.scheduler import Scheduler, SchedulerConfig, StepOutput

if TYPE_CHECKING:
    import torch

    from pdmesh_engine.model_runner import KVLayout


@dataclass(frozen=True)
class CoreStatus:
    """The engine at one moment (see `EngineCore.status`)."""

    num_running: int            # requests in the running batch
    num_waiting: int            # requests waiting to run or waiting for KV from elsewhere
    kv: KVCacheStats
    expert_weight_bytes: int    # routed-expert weights this rank holds (about 1/dp_size of them under DEP)


class EngineCore:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None,
                 dep: DEPContext | None = None) -> None:
        """`dep`: this engine is one rank of a DEP instance (see pdmesh_engine.parallel.dep); step() is collective."""
        self.config = config or EngineConfig()
        self.model_config = ModelConfig.from_dir(model_dir)
        self.runner = ModelRunner(model_dir, self.model_config, self.config,
                                  model_kwargs=dep.model_kwargs(self.model_config) if dep else None)
        layout = self.runner.kv_layout
        num_blocks = layout.num_blocks - (1 if dep else 0)     # DEP: the last block is the dummy forward's scratch
        self.kv = KVCacheManager(num_blocks, layout.block_size, self.config.enable_prefix_caching)
        self.max_model_len = min(self.config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings, num_blocks * layout.block_size)
        self.lockstep: LockstepStepper | None = None
        if dep is not None:
            self.lockstep = LockstepStepper(dep.dp_sync, self.runner, scratch_block=num_blocks)
        self.scheduler = Scheduler(SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                                   self.max_model_len), self.kv)
        self._ids = itertools.count()

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, hold_blocks: bool = False) -> str:
        """Queue a request; raises ValueError for an empty or too long prompt or a bad token id.

        With `hold_blocks` the KV blocks stay allocated after the request finishes, until
        `release_held()` (a prefill instance pushes them to decode first).
        """
        request = self._make_request(prompt_token_ids, params, request_id)
        request.hold_blocks = hold_blocks
        self.scheduler.add_request(request)
        return request.request_id

    def reserve(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> list[int] | None:
        """Hold blocks for a prompt whose KV another instance computes; None if the pool is short."""
        return self.scheduler.reserve(self._make_request(prompt_token_ids, params, request_id))

    def kv_arrived(self, request_id: str, first_token_id: int | None = None) -> StepOutput | None:
        """The reserved blocks hold the prompt's KV: decode from the first token on (see Scheduler)."""
        return self.scheduler.kv_arrived(request_id, first_token_id)

    def blocks_of(self, request_id: str) -> list[int]:
        return self.kv.blocks_of(request_id)

    def release_held(self, request_id: str) -> bool:
        return self.scheduler.release_held(request_id)

    def _make_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      request_id: str | None) -> Request:
        check_prompt(prompt_token_ids, vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len)
        params.validate_for_vocab(self.model_config.vocab_size)
        return Request(request_id or f"req-{next(self._ids)}", list(prompt_token_ids), params,
                       eos_token_ids=self.model_config.eos_token_ids)

    def step(self) -> list[StepOutput]:
        output = self.scheduler.schedule()
        if self.lockstep is not None:       # DEP: DP sync, then the batch, a dummy forward or nothing
            pending = self.scheduler.num_running + len(self.scheduler.waiting)
            sampled = self.lockstep.execute(output, self.scheduler.requests, pending)
        else:
            sampled = self.runner.execute(output, self.scheduler.requests)
        return self.scheduler.update_from_output(output, sampled)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

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
        return CoreStatus(self.scheduler.num_running, self.scheduler.num_waiting, self.kv.stats(),
                          self.runner.expert_weight_bytes())

    def request_ids(self) -> list[str]:
        """Every request this engine holds state or blocks for (queued, running, waiting for KV, held)."""
        return [*self.scheduler.requests, *self.scheduler.held]

    @property
    def kv_layout(self) -> KVLayout:
        return self.runner.kv_layout

    @property
    def kv_caches(self) -> torch.Tensor:
        """The KV pool, [num_layers, num_blocks, block_size, entry_dim] (what a NIXL agent registers)."""
        return self.runner.kv_caches
