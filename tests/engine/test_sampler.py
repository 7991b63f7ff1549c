"""Sampler: greedy, filtering order, seeding, distribution, logprobs, bans."""

from __future__ import annotations

import pytest
import torch

from pdmesh_engine.sampler import Sampler, row_argmax
from pdmesh_engine.sampling import SamplingParams as P

# B: batch, V: vocab


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draw(logits_row: torch.Tensor, params: P, n: int, seed: int = 0) -> torch.Tensor:
    """n independent samples of one row [V], as one batch of n rows sharing the default
    generator."""
    out = Sampler(seed=seed)(logits_row.expand(n, -1), [params] * n, [None] * n)
    return out.token_ids


def frequencies(tokens: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).double() / tokens.numel()


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


def test_greedy_equals_argmax_and_leaves_generators_alone() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    logits[2, 7] = logits[2, 3] = logits[2].max() + 1  # tie -> lowest id
    g = gen(1)
    state = g.get_state()
    out = Sampler()(logits, [P(temperature=0)] * 6, [g] * 6)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids[2] == 3
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None
    assert torch.equal(g.get_state(), state)  # greedy draws no noise


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_row_argmax_is_torch_argmax(dtype: torch.dtype) -> None:
    """The first of equal maxima, a NaN above everything, an all -inf row at 0, views of any
    stride: as torch picks them."""
    torch.manual_seed(0)
    x = torch.randn(8, 300)
    x[1, 5] = x[1, 77] = 100.0
    x[2, 9] = x[2, 200] = float("nan")
    x[3] = float("-inf")
    x[4] = 0.0
    x[5, 100] = x[5, 7] = float("inf")
    x = x.to(dtype)
    for view in (x, x[:, 1::3], x.t().contiguous().t(), x[2:6]):
        got = row_argmax(view)
        assert got.dtype == torch.int64
        assert torch.equal(got, view.argmax(dim=-1))
    assert row_argmax(x)[1:6].tolist() == [5, 9, 0, 0, 7]


def test_low_temperature_limit_is_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 50)
    sampler = Sampler(seed=0)
    for _ in range(20):
        out = sampler(logits, [P(temperature=1e-3)] * 8, [None] * 8)
        assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    torch.manual_seed(2)
    logits = torch.randn(16, 64)
    rows = [P(top_k=1, temperature=2.0)] * 8 + [P(top_p=1e-6, temperature=2.0)] * 8
    out = Sampler(seed=0)(logits, rows, [gen(i) for i in range(16)])
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_temperature_scales_the_distribution() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    for t in (0.5, 2.0):
        tokens = draw(logits, P(temperature=t), 20_000)
        assert chi_square(tokens, torch.softmax(logits / t, -1)) < 25.0  # df=4; p(>25) ~ 5e-5


def test_frequencies_match_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    tokens = draw(logits, P(), 20_000)
    probs = torch.softmax(logits, -1)
    assert chi_square(tokens, probs) < 25.0
    # and the chi-square is sensitive: a different distribution fails it
    assert chi_square(tokens, torch.softmax(logits * 0.8, -1)) > 25.0


def test_seeded_frequencies_match_softmax() -> None:
    """The per-row generator path (one generator per row) is also unbiased."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    n = 4000
    out = Sampler()(logits.expand(n, -1), [P(seed=i) for i in range(n)], [gen(i) for i in range(n)])
    assert chi_square(out.token_ids, torch.softmax(logits, -1)) < 25.0


def test_min_p_removes_unlikely_tokens() -> None:
    logits = torch.tensor([3.0, 2.5, 1.0, 0.0, -1.0, 2.9])
    probs = torch.softmax(logits, -1)
    min_p = 0.5
    allowed = probs >= min_p * probs.max()
    assert int(allowed.sum()) in range(2, 6)  # the test filters some but not all
    tokens = draw(logits, P(min_p=min_p), 5000)
    seen = torch.bincount(tokens, minlength=6) > 0
    assert torch.equal(seen, allowed)  # filtered never appear, all survivors do
    survivors = allowed.nonzero().squeeze(1)  # renormalised over the survivors (df=2)
    remap = torch.full((6,), -1, dtype=torch.int64)
    remap[survivors] = torch.arange(survivors.numel())
    kept = probs[survivors]
    assert chi_square(remap[tokens], kept / kept.sum()) < 20.0


def test_top_k_and_top_p_sets() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    seen = lambda p: set(draw(logits, p, 3000).tolist())  # noqa: E731
    assert seen(P(top_k=2)) == {0, 1}
    assert seen(P(top_k=3)) == {0, 1, 2}
    assert seen(P(top_p=0.7)) == {0, 1}  # 0.5 < 0.7 <= 0.8
    assert seen(P(top_p=0.85)) == {0, 1, 2}
    assert seen(P(top_p=1.0)) == {0, 1, 2, 3}
    assert seen(P(top_k=3, top_p=0.7)) == {0, 1}


def test_filter_order_min_p_then_top_k_then_top_p() -> None:
    """top-p sees the distribution renormalised after min-p and top-k (vLLM's order)."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    seen = lambda p: set(draw(logits, p, 2000).tolist())  # noqa: E731
    # top_p first would keep {0, 1} (0.4 < 0.5); after top_k=2 the renormalised 0.57 >= 0.5.
    assert seen(P(top_k=2, top_p=0.5)) == {0}
    # min_p=0.6 keeps {0, 1} (threshold 0.24), renormalised [0.57, 0.43]; then top_p=0.5 -> {0}.
    assert seen(P(min_p=0.6, top_p=0.5)) == {0}
    # min_p before top_k: min_p=0.7 keeps {0, 1}; top_k=3 leaves both.
    assert seen(P(min_p=0.7, top_k=3)) == {0, 1}


def test_same_seed_same_tokens_different_seed_different() -> None:
    torch.manual_seed(3)
    logits = torch.randn(1, 200)

    def run(seed: int) -> list[int]:
        g = gen(seed)
        sampler = Sampler()  # unseeded default generator: must not matter for seeded rows
        return [int(sampler(logits, [P(seed=seed)], [g]).token_ids[0]) for _ in range(30)]

    assert run(5) == run(5)
    a, b, c = run(5), run(6), run(7)
    assert a != b and a != c and b != c
    assert len(set(a)) > 5  # really sampling, not stuck


def test_seeded_row_is_independent_of_batch_company() -> None:
    torch.manual_seed(4)
    V = 300
    row = torch.randn(V)
    params = P(seed=11, temperature=0.9, top_k=50, top_p=0.95, min_p=0.01)

    alone_g, shared_g = gen(11), gen(11)
    alone, shared = Sampler(seed=1), Sampler(seed=2)
    for _ in range(15):
        a = alone(row.unsqueeze(0), [params], [alone_g]).token_ids[0]
        others = torch.randn(4, V)
        batch = torch.cat([others[:2], row.unsqueeze(0), others[2:]])
        ps = [P(temperature=0), P(), params, P(seed=3, top_k=5), P(top_p=0.5, logprobs=2)]
        gs = [None, None, shared_g, gen(3), None]
        b = shared(batch, ps, gs, banned_token_ids=[[1], [], [], [0, 2], []]).token_ids[2]
        assert a == b


def test_logprobs_are_raw_log_softmax_and_top_ids_the_argsort() -> None:
    torch.manual_seed(5)
    logits = torch.randn(4, 40)
    ps = [P(logprobs=3, temperature=0.7), P(), P(logprobs=5, temperature=0), P(logprobs=0, top_k=3)]
    out = Sampler(seed=0)(
        logits, ps, [None] * 4, banned_token_ids=[[], [], [int(logits[2].argmax())], []]
    )
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    assert out.logprobs.dtype == torch.float32 and out.top_ids.dtype == torch.int64
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == (4, 5) and out.top_logprobs.shape == (4, 5)
    assert torch.equal(out.top_ids, ref.argsort(-1, descending=True)[:, :5])
    torch.testing.assert_close(out.top_logprobs, ref.sort(-1, descending=True).values[:, :5])
    # row 2 is greedy with its argmax banned: it picks the runner-up, logprob still raw
    assert out.token_ids[2] == out.top_ids[2, 1]


def test_low_precision_logits() -> None:
    torch.manual_seed(6)
    logits = torch.randn(3, 30).to(torch.bfloat16)
    out = Sampler(seed=0)(logits, [P(temperature=0, logprobs=2), P(), P(top_p=0.9)], [None] * 3)
    assert out.token_ids[0] == logits.float().argmax(-1)[0]
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs[0], torch.log_softmax(logits.float(), -1)[0].max())


def test_banned_ids_never_sampled() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, 2.5])
    n = 3000
    banned = [[0, 4]] * n
    out = Sampler(seed=0)(
        logits.expand(n, -1).clone(), [P(temperature=1.5)] * n, [None] * n, banned
    )
    seen = set(out.token_ids.tolist())
    assert seen == {1, 2, 3}
    greedy = Sampler()(logits[None], [P(temperature=0)], [None], [[0]])
    assert greedy.token_ids.tolist() == [4]


def test_inputs_are_not_modified_and_bad_inputs_rejected() -> None:
    logits = torch.randn(2, 10)
    before = logits.clone()
    Sampler(seed=0)(
        logits, [P(temperature=0.5, top_k=3), P(min_p=0.2)], [None, gen(0)], [[1, 2], [3]]
    )
    assert torch.equal(logits, before)
    sampler = Sampler()
    with pytest.raises(ValueError, match="one SamplingParams and one generator per row"):
        sampler(logits, [P()], [None, None])
    with pytest.raises(ValueError, match="banned_token_ids"):
        sampler(logits, [P(), P()], [None, None], [[1]])
    with pytest.raises(ValueError, match=r"banned_token_ids must be in \[0, 10\)"):
        sampler(logits, [P(), P()], [None, None], [[10], []])
    with pytest.raises(ValueError, match="2-D"):
        sampler(logits[0], [P()], [None])
