"""The model runner: owns the weights, the KV memory and the sampler of one engine.

What differs between model families (loading, the KV layout and its manager) comes from the
checkpoint's family (`pdmesh_engine.model.registry.family_of`: `deepseek_v3.runtime.V3Family`,
`deepseek_v4.runtime.V4Family`); CUDA graphs and a draft model are V3's, MTP speculation runs on
both (V4's proposer keeps its KV in window-pool blocks, `V4MTPProposer`).

`execute(SchedulerOutput) -> {request_id: SampledToken}`: build a `ForwardBatch`, run the model
(a decode-only step where the Triton kernels run: by replaying a CUDA graph, see
pdmesh_engine.cuda_graphs), compute logits only for rows that sample, sample. The only place that
touches the device.

Per-request device state lives here, keyed by request id, not on the (pure) `Request`: a seeded
request's `torch.Generator` is made when the request is first sampled and dropped when the scheduler
reports it finished (`SchedulerOutput.finished_ids`, aborts included). Its state is a function of
(seed, tokens sampled so far): the sampler draws exactly one [V] Exp(1) vector per sample of a
non-greedy row, so a request whose first token was sampled elsewhere (decode after prefill) starts
one draw ahead, a migrated request starts `prior_output_tokens` draws ahead, and a preempted request
keeps its generator.

Speculative decoding (`EngineConfig.speculative_method`): `execute_spec` replaces `execute`; a
`SpecDecoder` (pdmesh_engine.spec_runner) verifies the scheduled drafts with this runner's model and
proposes the next ones with a proposer (pdmesh_engine.spec_proposer) whose KV cache is a second
tensor addressed by the same block ids. Its seeded requests draw a different (but reproducible)
stream than `execute` does. A draft model with MoE layers records its expert loads in a ring of its
own (`Proposer.expert_load`, the same window as the target's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdmesh_engine.checkpoint import DTYPES
from pdmesh_engine.config import EngineConfig, ModelConfig
from pdmesh_engine.cpu_dtype import auto_cpu_dtype
from pdmesh_engine.cuda_graphs import DecodeGraphs, capture_cuda, capture_eager
from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.grammar import masks_beside
from pdmesh_engine.model.deepseek_v3.model import DeepseekV3ForCausalLM
from pdmesh_engine.model.deepseek_v3.runtime import V3Family, load_model
from pdmesh_engine.model.deepseek_v4.model import DeepseekV4ForCausalLM
from pdmesh_engine.model.deepseek_v4.runtime import V4KVLayout
from pdmesh_engine.model.moe import ExpertLoadRecorder, PlacedExperts
from pdmesh_engine.model.registry import family_of
from pdmesh_engine.request import Request
from pdmesh_engine.sampler import Sampler, SamplerOutput
from pdmesh_engine.scheduler import SampledToken, SchedulerOutput, SpecTokens
from pdmesh_engine.spec_proposer import (
    DraftModelProposer,
    MTPProposer,
    Proposer,
    V4MTPProposer,
    check_draft,
)
from pdmesh_engine.spec_runner import SpecDecoder
from pdmesh_kernels import uses_triton


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """auto: on CPU bf16 where the CPU has native bf16 and it is measured faster for this model's
    shapes, else float32 (`cpu_dtype.auto_cpu_dtype`); on GPUs the checkpoint's dtype."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return auto_cpu_dtype(model_config)
    return DTYPES.get(model_config.torch_dtype, torch.bfloat16)


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        model_config: ModelConfig,
        config: EngineConfig,
        model: DeepseekV3ForCausalLM | None = None,
        model_kwargs: dict[str, Any] | None = None,
        draft_model_kwargs: Callable[[ModelConfig], dict[str, Any]] | None = None,
        reserve_scratch: bool = False,
    ) -> None:
        """`model_kwargs` go to the family's model (DEP: placements, this rank's slots, the
        dispatcher); `draft_model_kwargs(draft config)` those of a speculative draft model (DEP:
        its own placement on the same dispatcher). The last KV block is kept as `scratch_block`
        (written by padding and dummy passes, never handed to a request) with `reserve_scratch`
        (DEP's dummy forwards) or CUDA graphs; a V4 runner keeps its window pool's last block too
        (`scratch_window_block`)."""
        self.family = family_of(model_config)
        config = self.family.engine_config(config)
        self.config, self.model_config = config, model_config
        self.model_kwargs = model_kwargs or {}
        self.draft_model_kwargs = draft_model_kwargs
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        self.load_seconds = 0.0
        self.model = model if model is not None else self._load_model(Path(model_dir))
        self.proposer = self._make_proposer(Path(model_dir)) if config.num_spec_tokens else None
        extra = self.proposer.kv_bytes_per_block(config.block_size) if self.proposer else 0
        self.kv_layout = self.family.plan_kv(config, self.dtype, extra)
        self.kv_caches = self.family.allocate_kv(self.kv_layout, self.device)
        use_graphs = (
            config.cuda_graph_max_batch > 0
            and uses_triton(self.device)
            and isinstance(self.family, V3Family)
        )
        self.scratch_block = (
            self.kv_layout.num_blocks - 1 if reserve_scratch or use_graphs else None
        )
        # V4: the window pool's last block goes with it, so that a dummy pass's per-token rows
        # land in no request's block either (`deepseek_v4.runtime.make_kv_manager`)
        self.scratch_window_block = (
            self.kv_layout.num_window_blocks - 1
            if self.scratch_block is not None and isinstance(self.kv_layout, V4KVLayout)
            else None
        )
        self.graphs = self._make_graphs() if use_graphs else None
        self.sampler = Sampler(seed=config.seed)
        # a windowed family's second block table per request (set by the engine that owns the
        # KV manager, pdmesh_engine.kv_window); None: one table
        self.window_tables: Callable[[str], list[int]] | None = None
        # seeded requests being served, by request id
        self.generators: dict[str, torch.Generator] = {}
        self.spec: SpecDecoder | None = None
        if self.proposer is not None:
            self.proposer.allocate_kv(self._proposer_blocks(), config.block_size)
            self.spec = SpecDecoder(self, self.proposer, config.num_spec_tokens)
        moe = self.model.moe_layers
        self.expert_load = (
            ExpertLoadRecorder(
                len(moe), moe[0].placement.num_physical, config.expert_load_window, self.device
            )
            if moe
            else None
        )

    def _make_graphs(self) -> DecodeGraphs:
        """Decode graphs over every block table up to the longest sequence the engine admits."""
        assert self.scratch_block is not None
        block_size = self.config.block_size
        max_len = self.config.context_limit(self.model_config, self.scratch_block * block_size)
        capture = capture_cuda() if self.device.type == "cuda" else capture_eager
        return DecodeGraphs(
            self.model,
            self.kv_caches,
            self.scratch_block,
            min(self.config.cuda_graph_max_batch, self.config.max_num_seqs),
            -(-max_len // block_size),
            capture,
        )

    def expert_weight_bytes(self) -> int:
        """Bytes of the routed experts' weights held here (w13 + w2 of every MoE layer, MTP and a
        draft model's included)."""
        models = [self.model]
        if isinstance(self.proposer, DraftModelProposer):
            models.append(self.proposer.model)
        return sum(
            m.w13.nbytes + m.w2.nbytes
            for model in models
            for m in model.modules()
            if isinstance(m, PlacedExperts)
        )

    def dispatch_stats(self) -> Any:
        """The MoE dispatcher's per-phase timings (DEP: a `DispatchStats`), None for in-process
        experts."""
        moe = self.model.moe_layers
        return getattr(moe[0].dispatcher, "stats", None) if moe else None

    def _load_model(self, model_dir: Path) -> DeepseekV3ForCausalLM:
        start = time.perf_counter()
        model = self.family.load(model_dir, self.device, self.dtype, self.model_kwargs)
        self.load_seconds = time.perf_counter() - start
        return model

    def _make_proposer(self, model_dir: Path) -> Proposer:
        """The speculative proposer of the config's method; ValueError if the checkpoints do not
        fit it (mtp: no MTP layer; draft_model: another vocabulary or tokenizer)."""
        k = self.config.num_spec_tokens
        if self.config.speculative_method == "mtp":
            if isinstance(self.model, DeepseekV4ForCausalLM):
                return V4MTPProposer(self.model, k, self.dtype, self.device)
            return MTPProposer(self.model, k, self.dtype, self.device)
        draft_dir = Path(self.config.draft_model or "")
        draft_config = ModelConfig.from_dir(draft_dir)
        check_draft(model_dir, self.model_config, draft_dir, draft_config)
        kwargs = self.draft_model_kwargs(draft_config) if self.draft_model_kwargs else None
        draft = load_model(draft_dir, draft_config, self.device, self.dtype, kwargs, load_mtp=False)
        proposer = DraftModelProposer(draft, k, self.dtype, self.device)
        moe = draft.moe_layers
        if moe:
            proposer.expert_load = ExpertLoadRecorder(
                len(moe), moe[0].placement.num_physical, self.config.expert_load_window, self.device
            )
        return proposer

    def _proposer_blocks(self) -> int:
        """Blocks of the proposer's cache: the pool its block ids address (V4: the window
        pool)."""
        if isinstance(self.kv_layout, V4KVLayout):
            return self.kv_layout.num_window_blocks
        return self.kv_layout.num_blocks

    @torch.inference_mode()
    def execute(
        self, output: SchedulerOutput, requests: dict[str, Request]
    ) -> dict[str, SampledToken]:
        """Run one scheduled step (`requests`: the scheduler's live requests by id); forget finished
        ones first."""
        self.end_requests(output.finished_ids)
        if output.is_empty:
            return {}
        items = output.scheduled
        batch = ForwardBatch.build(
            [s.token_ids for s in items],
            [s.start_position for s in items],
            [s.block_ids for s in items],
            self.config.block_size,
            [s.needs_sample for s in items],
            self.device,
            [self.window_tables(s.request_id) for s in items] if self.window_tables else None,
        )
        sampling = [requests[s.request_id] for s in items if s.needs_sample]
        masks = masks_beside(  # structured outputs' masks, computed beside the forward
            [(r.grammar, row, ()) for row, r in enumerate(sampling)],
            len(sampling),
            self.model_config.vocab_size,
        )
        if self.graphs is not None and self.graphs.takes(batch):
            hidden = self.graphs.run(batch, self.expert_load)
        else:
            hidden = self.model(batch, self.kv_caches, self.expert_load)
        if self.expert_load is not None:
            self.expert_load.end_step()
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        result = self.sampler(
            logits,
            [r.sampling_params for r in sampling],
            [self._generator(r) for r in sampling],
            [r.banned_token_ids() for r in sampling],
            torch.from_numpy(masks.result()) if masks is not None else None,
        )
        return self._to_tokens(sampling, result)

    @torch.inference_mode()
    def execute_spec(
        self, output: SchedulerOutput, requests: dict[str, Request]
    ) -> dict[str, SpecTokens]:
        """`execute` with speculative decoding: every request whose chunk samples gets the tokens
        its step emits and its next drafts (`SpecDecoder.execute`)."""
        if self.spec is None:
            raise RuntimeError("execute_spec needs an engine with a speculative_method")
        self.end_requests(output.finished_ids)
        if output.is_empty:
            return {}
        return self.spec.execute(output, requests)

    def end_requests(self, request_ids: list[str]) -> None:
        """Drop the per-request state of requests that finished or were aborted."""
        for request_id in request_ids:
            self.generators.pop(request_id, None)
        if self.spec is not None:
            self.spec.end_requests(request_ids)

    def generator_for(self, request: Request) -> torch.Generator | None:
        return self._generator(request)

    def _generator(self, request: Request) -> torch.Generator | None:
        """The seeded request's generator (made on its first sample), None for an unseeded one."""
        seed = request.sampling_params.seed
        if seed is None:
            return None
        generator = self.generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            params = request.sampling_params
            if not params.is_greedy:  # tokens sampled before this engine saw it
                self.sampler.skip_draws(
                    generator,
                    self.model_config.vocab_size,
                    params.prior_output_tokens + request.num_output_tokens,
                )
            self.generators[request.request_id] = generator
        return generator

    @staticmethod
    def _to_tokens(requests: list[Request], result: SamplerOutput) -> dict[str, SampledToken]:
        token_ids = result.token_ids.tolist()
        logprobs = result.logprobs.tolist() if result.logprobs is not None else None
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        out: dict[str, SampledToken] = {}
        for row, request in enumerate(requests):
            wanted = request.sampling_params.logprobs
            if wanted is None or logprobs is None:
                out[request.request_id] = SampledToken(token_ids[row])
                continue
            top = (
                tuple(zip(top_ids[row][:wanted], top_lps[row][:wanted], strict=True))
                if wanted and top_ids
                else ()
            )
            out[request.request_id] = SampledToken(token_ids[row], logprobs[row], top)
        return out
