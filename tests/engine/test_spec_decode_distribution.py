"""Sampled outputs with speculative decoding follow the target's distribution, end to end through
the engine: a two-sample chi-square test of speculation on against off on a small outcome space
(temperature 1, top-k 3, three tokens: at most 27 outcomes), with a draft model whose distribution
differs from the target's (so drafts are often rejected and the residual is sampled). The same test
rejects an engine whose acceptance rule is wrong (always accept), so it can fail.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from pdmesh.tools.model_init import init_model
from pdmesh_engine import LLM, EngineConfig, SamplingParams

N = 1500  # samples per side
PROMPT = [0, 17, 300, 5, 901, 44, 12]
BASE = dict(num_blocks=512, block_size=16, device="cpu", num_threads=1, max_num_seqs=256)


def chi2_quantile(df: int, z: float = 3.72) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at normal z (3.72: p = 1e-4)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def homogeneity_chi2(a: Counter, b: Counter) -> tuple[float, int]:
    """(statistic, degrees of freedom) of two equal-size samples over their outcomes."""
    outcomes = set(a) | set(b)
    stat = sum((a[o] - b[o]) ** 2 / (a[o] + b[o]) for o in outcomes)
    return stat, len(outcomes) - 1


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dist")
    return {
        "tiny": init_model(root / "tiny", "tiny", seed=0, verbose=False),
        "draft": init_model(root / "draft", "tiny-draft", seed=1, verbose=False),
    }


def sample(models: dict[str, Path], first_seed: int, **spec: object) -> Counter:
    llm = LLM(models["tiny"], EngineConfig(**BASE, **spec))
    params = [
        SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=first_seed + i)
        for i in range(N)
    ]
    outputs = llm.generate([PROMPT] * N, params)
    llm.engine.check_integrity()
    return Counter(tuple(o.token_ids) for o in outputs)


@pytest.fixture(scope="module")
def speculation_off(models: dict[str, Path]) -> Counter:
    return sample(models, 0)


def _draft(models: dict[str, Path], k: int) -> dict[str, object]:
    return dict(
        speculative_method="draft_model", num_speculative_tokens=k, draft_model=str(models["draft"])
    )


@pytest.mark.parametrize("k", [1, 2])
def test_speculation_keeps_the_target_distribution(
    models: dict[str, Path], speculation_off: Counter, k: int
) -> None:
    on = sample(models, 10 * N, **_draft(models, k))
    stat, df = homogeneity_chi2(speculation_off, on)
    assert df >= 8  # a real spread of outcomes
    assert stat < chi2_quantile(df), (stat, df)


def test_a_wrong_acceptance_rule_is_detected(
    models: dict[str, Path], speculation_off: Counter, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pdmesh_engine.spec_runner as spec_runner

    def always_accept(drafts, target_probs, draft_probs, generator=None):  # noqa: ANN001
        return [*drafts, int(target_probs[len(drafts)].argmax())], len(drafts)

    monkeypatch.setattr(spec_runner, "rejection_sample", always_accept)
    wrong = sample(models, 20 * N, **_draft(models, 2))
    stat, df = homogeneity_chi2(speculation_off, wrong)
    assert stat > chi2_quantile(df), (stat, df)
