"""Exactness against the reference: the engine's logits and greedy tokens equal
`transformers.DeepseekV3ForCausalLM`'s.

The reference models are tiny random checkpoints (tests/conftest.py, `reference_models`) that vary
every architectural knob the engine reads: layers, dense-first layers, experts, top-k, group-limited
routing, q-LoRA on/off, latent and head sizes, interleaved and plain rope, yarn scaling (with mscale
equal to and different from mscale_all_dim), top-k normalisation, routed scaling, shared experts,
attention biases.

- full-sequence logits (one prefill) and teacher-forced logits through chunked prefill plus
  absorbed-MLA decode steps over a scattered paged cache, for every model, within FP32_ATOL of
  transformers in fp32, also with the decode attention read in many chunks (online softmax);
- greedy generation of mixed-length prompts (chunked prefills and decodes in the same steps, shared
  prefixes served from the prefix cache) token for token equal to `generate()`, one prompt at a
  time;
- a request's tokens and logprobs do not depend on what else is in the batch;
- bf16 stays within stated tolerances of the fp32 reference, as close as transformers' own bf16 run;
- requests preempted for lack of KV blocks and recomputed still give the reference tokens;
- after every engine run all KV blocks are back (`check_integrity`, no block in use).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("transformers")

from pdmesh_engine import EngineConfig, EngineCore, SamplingParams  # noqa: E402
from pdmesh_engine.forward_batch import ForwardBatch  # noqa: E402
from pdmesh_engine.model.deepseek_v3 import attention  # noqa: E402

MODELS = ("base", "yarn_noqlora", "yarn_dense2")
FP32_ATOL = 1e-4  # max |logit difference| to transformers in fp32
LOGPROB_ATOL = 1e-4  # engine logprob of a sampled token vs log_softmax of transformers' logits
BATCH_INVARIANCE_ATOL = 1e-5
# bf16 (weights, activations, KV cache) against the fp32 reference. These random models route
# sharply (logit std about 1.2, many near-tied experts and tokens), so a bf16 rounding sometimes
# flips an expert choice and moves a few positions' logits by several units: transformers' own bf16
# run does the same (measured over 3 models x 3 prompt sets: median per-position max |diff|
# 0.07-0.10, top-1 agreement 0.88-0.97, for transformers-bf16 and for the engine alike). A wrong
# computation moves every position.
BF16_MEDIAN_MAX_ABS = 0.2  # median over positions of max |logit diff| (measured 0.07-0.11)
# fraction of positions whose argmax equals the reference's (measured 0.89-0.97)
BF16_TOP1_AGREEMENT = 0.8
# mean |logit diff| at most this times transformers-bf16's (measured ratio <= 1.45)
BF16_VS_TRANSFORMERS = 2.0
NUM_NEW = 32


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """The models are tiny: threads only add contention on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----- helpers -----


def make_engine(ref, **overrides) -> EngineCore:
    settings = dict(
        block_size=4,
        num_blocks=512,
        max_num_batched_tokens=64,
        max_num_seqs=16,
        dtype="float32",
        device="cpu",
    )
    return EngineCore(ref.path, EngineConfig(**{**settings, **overrides}))


def random_ids(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(ref, ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(ids), V] (fp32) of one full sequence."""
    with torch.no_grad():
        return ref.model(torch.tensor([ids])).logits[0].float()


def reference_generate(
    ref, prompt: list[int], num_new: int = NUM_NEW
) -> tuple[list[int], torch.Tensor]:
    """transformers greedy continuation (no padding, one prompt) and its raw logits [num_new, V]."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=ref.model.config.eos_token_id,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


def greedy_params(logprobs: int | None = 0) -> SamplingParams:
    """Greedy, exactly NUM_NEW tokens. min_tokens bans EOS until then, as
    `generate(min_new_tokens=...)` does."""
    return SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0, logprobs=logprobs)


@dataclass
class Result:
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    num_cached_tokens: int
    finish_reason: str | None = None


def run_engine(
    eng: EngineCore, prompts: dict[str, list[int]], params: SamplingParams
) -> dict[str, Result]:
    """Submit all prompts at once, step until done; checks that every KV block came back."""
    for request_id, prompt in prompts.items():
        eng.add_request(prompt, params, request_id=request_id)
    results = {request_id: Result([], [], [], 0) for request_id in prompts}
    steps = 0
    while eng.has_unfinished:
        for out in eng.step():
            r = results[out.request_id]
            r.tokens.extend(out.new_token_ids)
            r.logprobs.extend(out.new_logprobs)
            r.top_logprobs.extend(out.new_top_logprobs)
            r.num_cached_tokens = out.num_cached_tokens
            r.finish_reason = out.finish_reason
        eng.check_integrity()
        steps += 1
        assert steps < 10_000, "the engine does not make progress"
    assert_all_blocks_back(eng)
    return results


def assert_all_blocks_back(eng: EngineCore) -> None:
    eng.check_integrity()
    stats = eng.kv_stats()
    assert stats.num_used == 0, (
        f"{stats.num_used} KV blocks still in use after all requests finished"
    )
    assert stats.num_free + stats.num_cached == stats.num_blocks


@dataclass
class DrivenSequence:
    """One sequence driven by hand through the model: its tokens, its (scattered) blocks, how many
    are computed."""

    ids: list[int]
    blocks: list[int]
    chunks: list[int]  # prefill chunk sizes; decodes of one token follow until all ids are computed
    first_step: int = 0
    done: int = 0

    def next_count(self, step: int) -> int:
        if step < self.first_step or self.done == len(self.ids):
            return 0
        index = step - self.first_step
        return self.chunks[index] if index < len(self.chunks) else 1


def teacher_forced_logits(eng: EngineCore, seqs: list[DrivenSequence]) -> list[torch.Tensor]:
    """Run `seqs` together through `eng`'s model step by step (decodes first, as the scheduler
    orders them) and return each sequence's logits [len(ids), V] at every position, fp32."""
    model, caches, block_size = eng.runner.model, eng.runner.kv_caches, eng.config.block_size
    out = [torch.full((len(s.ids), model.config.vocab_size), float("nan")) for s in seqs]
    step = 0
    while any(s.done < len(s.ids) for s in seqs):
        work = [(s, i, s.next_count(step)) for i, s in enumerate(seqs)]
        work = sorted((w for w in work if w[2]), key=lambda w: w[2] != 1)
        step += 1
        if not work:
            continue
        batch = ForwardBatch.build(
            [s.ids[s.done : s.done + n] for s, _, n in work],
            [s.done for s, _, n in work],
            [s.blocks for s, _, n in work],
            block_size,
            [True] * len(work),
            eng.runner.device,
        )
        with torch.inference_mode():
            logits = model.compute_logits(model(batch, caches)).float().cpu()
        for row, (s, i, n) in enumerate(work):
            begin = batch.query_start_list[row]
            out[i][s.done : s.done + n] = logits[begin : begin + n]
            s.done += n
    assert all(not o.isnan().any() for o in out), "the plan left positions uncomputed"
    return out


def mixed_sequences(ref, num_blocks: int, block_size: int) -> list[DrivenSequence]:
    """Two sequences with scattered, interleaved blocks: A prefills in two chunks, B starts while A
    is mid-prefill, A's first decode shares a step with B's second chunk, then both decode one token
    a step."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7)).tolist()
    a = random_ids(1, 35, ref.vocab_size)
    b = random_ids(2, 29, ref.vocab_size)
    need_a, need_b = -(-len(a) // block_size), -(-len(b) // block_size)
    return [
        DrivenSequence(a, order[0 : 2 * need_a : 2], chunks=[10, 13]),
        DrivenSequence(b, order[1 : 2 * need_b + 1 : 2], chunks=[9, 8], first_step=1),
    ]


# ----- (a) logits -----


@pytest.mark.parametrize("name", MODELS)
def test_full_sequence_logits_match_reference(reference_models, name):
    ref = reference_models[name]
    eng = make_engine(ref)
    ids = random_ids(11, 150, ref.vocab_size)  # positions past yarn's original 128
    blocks = torch.randperm(64, generator=torch.Generator().manual_seed(3)).tolist()[
        : -(-len(ids) // 4)
    ]
    batch = ForwardBatch.build([ids], [0], [blocks], 4, [True], torch.device("cpu"))
    with torch.inference_mode():
        ours = eng.runner.model.compute_logits(eng.runner.model(batch, eng.runner.kv_caches))
    expected = reference_logits(ref, ids)
    assert ours.shape == expected.shape
    diff = (ours - expected).abs().max().item()
    assert diff <= FP32_ATOL, f"{name}: max |logit diff| {diff:.2e} > {FP32_ATOL}"
    assert_all_blocks_back(eng)


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill_and_decode_logits_match_reference(reference_models, name):
    """Every position's logits, computed through prefill chunks over cached context and single-token
    absorbed-MLA decodes over a paged cache, mixed in the same steps with another sequence."""
    ref = reference_models[name]
    eng = make_engine(ref)
    seqs = mixed_sequences(ref, 64, eng.config.block_size)
    ours = teacher_forced_logits(eng, seqs)
    for seq, logits in zip(seqs, ours, strict=True):
        expected = reference_logits(ref, seq.ids)
        prompt_len = sum(seq.chunks)
        prefill = (logits[:prompt_len] - expected[:prompt_len]).abs().max().item()
        decode = (logits[prompt_len:] - expected[prompt_len:]).abs().max().item()
        assert prefill <= FP32_ATOL, f"{name}: chunked prefill max |logit diff| {prefill:.2e}"
        assert decode <= FP32_ATOL, f"{name}: decode max |logit diff| {decode:.2e}"
    assert_all_blocks_back(eng)


def test_decode_attention_in_many_chunks_matches_reference(reference_models, monkeypatch):
    """The online-softmax decode attention (here one block position per chunk, so every decode
    step of the longer sequence reads 8+ chunks) gives the reference's logits too."""
    monkeypatch.setattr(attention, "CHUNK_ROWS", 1)
    monkeypatch.setattr(attention, "ONE_READ_ROWS", 0)
    ref = reference_models["base"]
    eng = make_engine(ref)
    seqs = mixed_sequences(ref, 64, eng.config.block_size)
    ours = teacher_forced_logits(eng, seqs)
    for seq, logits in zip(seqs, ours, strict=True):
        expected = reference_logits(ref, seq.ids)
        decode = (logits[sum(seq.chunks) :] - expected[sum(seq.chunks) :]).abs().max().item()
        assert decode <= FP32_ATOL, f"many-chunk decode max |logit diff| {decode:.2e}"
    assert_all_blocks_back(eng)


# ----- (b) greedy generation -----


def generation_prompts(vocab: int) -> dict[str, list[int]]:
    """16 prompts of 3..90 tokens; shared-0..3 start with the same 28 tokens (7 blocks of 4)."""
    lengths = [3, 90, 17, 41, 5, 64, 29, 8, 77, 12, 53, 33]
    prompts = {f"p{i:02d}-{n}": random_ids(100 + i, n, vocab) for i, n in enumerate(lengths)}
    shared = random_ids(99, 28, vocab)
    for i, tail in enumerate((6, 1, 19, 40)):
        prompts[f"shared-{i}"] = shared + random_ids(200 + i, tail, vocab)
    return prompts


@pytest.fixture(scope="module")
def base_reference_outputs(reference_models) -> dict[str, tuple[list[int], torch.Tensor]]:
    ref = reference_models["base"]
    return {
        rid: reference_generate(ref, prompt)
        for rid, prompt in generation_prompts(ref.vocab_size).items()
    }


def test_greedy_generation_matches_reference(reference_models, base_reference_outputs):
    ref = reference_models["base"]
    prompts = generation_prompts(ref.vocab_size)
    eng = make_engine(ref, max_num_batched_tokens=64, block_size=4)
    mixed_steps = _count_mixed_steps(eng)
    results = run_engine(eng, prompts, greedy_params(logprobs=5))
    for rid, (expected, expected_logits) in base_reference_outputs.items():
        got = results[rid]
        assert got.tokens == expected, f"{rid}: engine {got.tokens} != transformers {expected}"
        assert got.finish_reason == "length"
        # Raw logprobs of the engine's decode steps against log_softmax of transformers' logits.
        raw = torch.log_softmax(expected_logits, dim=-1)
        chosen = raw.gather(1, torch.tensor(expected)[:, None])[:, 0]
        top_ids = torch.tensor([[t for t, _ in row] for row in got.top_logprobs])
        top_values = torch.tensor([[lp for _, lp in row] for row in got.top_logprobs])
        assert top_ids.shape == (NUM_NEW, 5)
        assert (torch.tensor(got.logprobs) - chosen).abs().max().item() <= LOGPROB_ATOL, rid
        assert (top_values - raw.topk(5).values).abs().max().item() <= LOGPROB_ATOL, rid
        assert (top_values - raw.gather(1, top_ids)).abs().max().item() <= LOGPROB_ATOL, rid
    assert mixed_steps[0] > 0, "no step mixed decodes with prefill chunks"
    cached = {rid: r.num_cached_tokens for rid, r in results.items() if rid.startswith("shared")}
    assert any(n >= 24 for n in cached.values()), (
        f"the shared prefix was not served from the cache: {cached}"
    )
    assert all(
        r.num_cached_tokens == 0 for rid, r in results.items() if not rid.startswith("shared")
    )


def _count_mixed_steps(eng: EngineCore) -> list[int]:
    """Wrap the scheduler to count steps holding both a decode and a multi-token chunk; returns a
    live counter."""
    counter = [0]
    schedule = eng.scheduler.schedule

    def counting_schedule():
        output = schedule()
        sizes = {len(s.token_ids) for s in output.scheduled}
        counter[0] += int(1 in sizes and any(n > 1 for n in sizes))
        return output

    eng.scheduler.schedule = counting_schedule
    return counter


# ----- (c) batch invariance -----


def test_output_does_not_depend_on_the_batch(reference_models):
    ref = reference_models["base"]
    target = random_ids(500, 37, ref.vocab_size)
    params = greedy_params(logprobs=3)
    others = generation_prompts(ref.vocab_size)
    different = {f"d{i}": random_ids(600 + i, 2 + 7 * i, ref.vocab_size) for i in range(15)}
    batches = {
        "alone": {"t": target},
        "first of 16": {"t": target, **dict(list(others.items())[:15])},
        "last of 16": {**dict(list(others.items())[1:]), "t": target},
        "with different others": {**different, "t": target},
    }
    runs = {
        label: run_engine(make_engine(ref), prompts, params)["t"]
        for label, prompts in batches.items()
    }
    alone = runs["alone"]
    assert len(alone.tokens) == NUM_NEW and len(alone.top_logprobs) == NUM_NEW
    for label, got in runs.items():
        assert got.tokens == alone.tokens, f"{label}: tokens differ from the request run alone"
        diff = (torch.tensor(got.logprobs) - torch.tensor(alone.logprobs)).abs().max().item()
        assert diff <= BATCH_INVARIANCE_ATOL, f"{label}: logprobs differ by {diff:.2e}"
        for mine, ref_top in zip(got.top_logprobs, alone.top_logprobs, strict=True):
            assert [t for t, _ in mine] == [t for t, _ in ref_top]
            assert (
                max(abs(a - b) for (_, a), (_, b) in zip(mine, ref_top, strict=True))
                <= BATCH_INVARIANCE_ATOL
            )


# ----- (d) bf16 -----


@pytest.mark.parametrize("name", MODELS)
def test_bf16_stays_close_to_fp32_reference(reference_models, name):
    ref = reference_models[name]
    eng = make_engine(ref, dtype="bfloat16")
    assert eng.runner.kv_caches.dtype == torch.bfloat16
    seqs = mixed_sequences(ref, 64, eng.config.block_size)
    ours = torch.cat(teacher_forced_logits(eng, seqs))
    expected = torch.cat([reference_logits(ref, s.ids) for s in seqs])
    reference_bf16 = copy.deepcopy(ref.model).to(torch.bfloat16)
    with torch.no_grad():
        theirs = torch.cat([reference_bf16(torch.tensor([s.ids])).logits[0].float() for s in seqs])
    diff = (ours - expected).abs()
    median = diff.max(-1).values.median().item()
    top1 = (ours.argmax(-1) == expected.argmax(-1)).float().mean().item()
    ratio = diff.mean().item() / (theirs - expected).abs().mean().item()
    assert diff.max().item() > 0, "the bf16 run is bit-identical to fp32: it did not run in bf16"
    assert median <= BF16_MEDIAN_MAX_ABS, (
        f"{name}: bf16 median per-position max |logit diff| {median:.3f}"
    )
    assert top1 >= BF16_TOP1_AGREEMENT, f"{name}: bf16 top-1 agreement {top1:.3f}"
    assert ratio <= BF16_VS_TRANSFORMERS, (
        f"{name}: bf16 mean |logit diff| is {ratio:.2f}x transformers-bf16's"
    )
    assert_all_blocks_back(eng)


# ----- (f) preemption -----


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_requests_still_match_reference(reference_models, prefix_caching):
    """With prefix caching a preempted request gets its own freed blocks back from the cache;
    without, it recomputes prompt and outputs from scratch."""
    ref = reference_models["yarn_noqlora"]
    prompts = {
        f"r{i}": random_ids(300 + i, n, ref.vocab_size) for i, n in enumerate((21, 9, 30, 14, 25))
    }
    # Each request needs up to ceil((30 + 32) / 4) = 16 blocks; together they need ~60, the pool has
    # 24.
    eng = make_engine(
        ref,
        num_blocks=24,
        block_size=4,
        max_num_batched_tokens=32,
        enable_prefix_caching=prefix_caching,
    )
    preempted: list[str] = []
    schedule = eng.scheduler.schedule

    def recording_schedule():
        output = schedule()
        preempted.extend(output.preempted_ids)
        return output

    eng.scheduler.schedule = recording_schedule
    results = run_engine(eng, prompts, greedy_params(logprobs=None))
    assert len(preempted) >= 2, f"expected preemptions with 24 blocks, got {preempted}"
    for rid, prompt in prompts.items():
        expected, _ = reference_generate(ref, prompt)
        assert results[rid].tokens == expected, (
            f"{rid} (preempted {preempted.count(rid)}x) differs from transformers"
        )
