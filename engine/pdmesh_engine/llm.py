"""The offline drivers. `LLM`: text or token ids in, completions out, all prompts batched together.

    llm = LLM(model_dir)
    outputs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=16, temperature=0))

`run_lockstep(engine)`: steps one rank of a DEP instance until no rank has requests left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdmesh_engine.checkpoint import embedded_model_dir
from pdmesh_engine.config import EngineConfig
from pdmesh_engine.engine_core import EngineCore
from pdmesh_engine.parallel.dep import LockstepRecord
from pdmesh_engine.sampling import SamplingParams, find_stop_string
from pdmesh_engine.scheduler import StepOutput
from pdmesh_engine.tokenizer import IncrementalDetokenizer, Tokenizer

Prompt = str | list[int] | dict


@dataclass(slots=True)
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    """Turns step outputs into text per request, and ends requests that meet a stop string."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, tuple[CompletionOutput, IncrementalDetokenizer, SamplingParams]] = {}

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        self.states[request_id] = (CompletionOutput(request_id, prompt_ids), detok, params)

    def process(self, step: StepOutput, finish: Callable[[str, str], None]) -> CompletionOutput:
        """Take one step's tokens in order; a step with several (speculative decoding) is read a
        token at a time, so a stop string ends the output where one token per step would have,
        and tokens after it are dropped."""
        out, detok, params = self.states[step.request_id]
        out.num_cached_tokens = step.num_cached_tokens
        ids = step.new_token_ids
        for i in range(max(len(ids), 1)):
            is_last = i >= len(ids) - 1
            if self._take(step, i, is_last, out, detok, params, finish):
                break
        if out.finished:
            del self.states[step.request_id]
        return out

    @staticmethod
    def _take(
        step: StepOutput,
        i: int,
        is_last: bool,
        out: CompletionOutput,
        detok: IncrementalDetokenizer,
        params: SamplingParams,
        finish: Callable[[str, str], None],
    ) -> bool:
        """Add the step's token i (with its logprobs); True if a stop string ended the output."""
        out.token_ids.extend(step.new_token_ids[i : i + 1])
        out.logprobs.extend(step.new_logprobs[i : i + 1])
        out.top_logprobs.extend(step.new_top_logprobs[i : i + 1])
        delta = detok.push(step.new_token_ids[i : i + 1])
        finish_reason = step.finish_reason if is_last else None
        if finish_reason is not None:
            delta += detok.flush()  # the stream ends: emit a held-back incomplete character too
        out.text += delta
        out.finish_reason, out.stop_reason = finish_reason, step.stop_reason if is_last else None
        # a stop string may still cut a running request, or the text of one that ran out of length
        if not params.stop or out.finish_reason not in (None, "length"):
            return False
        hit = find_stop_string(out.text, params.stop, len(delta))
        if hit is None:
            return False
        index, stop = hit
        out.text = (
            out.text[: index + len(stop)] if params.include_stop_str_in_output else out.text[:index]
        )
        if step.finish_reason is None:
            finish(step.request_id, stop)
        out.finish_reason, out.stop_reason = "stop", stop
        return True


class LLM:
    def __init__(
        self, model_dir: str | Path | None = None, config: EngineConfig | None = None, **overrides
    ) -> None:
        """`model_dir` None: the embedded default model (`checkpoint.embedded_model_dir`)."""
        model_dir = embedded_model_dir() if model_dir is None else model_dir
        if overrides:
            config = EngineConfig(**{**(config.__dict__ if config else {}), **overrides})
        self.engine = EngineCore(model_dir, config)
        self.tokenizer = Tokenizer.from_dir(model_dir)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_ids" in prompt:
                return list(prompt["prompt_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Submit every prompt at once, run until all finish; outputs in input order."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        processor = OutputProcessor(self.tokenizer)
        ids = []
        for prompt, p in zip(prompts, params_list, strict=True):
            prompt_ids = self.encode_prompt(prompt)
            ids.append(self.engine.add_request(prompt_ids, p))
            processor.add(ids[-1], prompt_ids, p)
        results: dict[str, CompletionOutput] = {}
        while self.engine.has_unfinished:
            for step in self.engine.step():
                out = processor.process(step, self.engine.finish)
                if out.finished:
                    results[out.request_id] = out
        return [results[i] for i in ids]


def run_lockstep(
    engine: EngineCore,
    before_step: Callable[[int], None] | None = None,
    after_step: Callable[[int, LockstepRecord], None] | None = None,
    max_steps: int = 1_000_000,
) -> list[StepOutput]:
    """Offline driver: step until no rank has requests left. Every rank calls it (same `max_steps`).

    `before_step(index)` runs at each step boundary (add requests, swap placements: the same on all
    ranks where it matters), `after_step(index, record)` after each step. Returns this rank's step
    outputs.
    """
    if engine.lockstep is None:
        raise ValueError("run_lockstep needs an EngineCore built with dep=DEPContext")
    outputs: list[StepOutput] = []
    for index in range(max_steps):
        if before_step is not None:
            before_step(index)
        outputs.extend(engine.step())
        record = engine.lockstep.last
        if after_step is not None:
            after_step(index, record)
        if engine.lockstep.all_done:
            return outputs
    raise RuntimeError(f"DEP ranks still had work after {max_steps} steps")
