"""The pure parts of speculative decoding (pdmesh_engine.spec_decode): the greedy acceptance rule,
rejection sampling (its output follows the target distribution, checked statistically, and a
wrong acceptance rule fails the same check), and the acceptance statistics."""

from __future__ import annotations

import pytest
import torch

from pdmesh_engine.sampler import filtered_probs
from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.spec_decode import SpecDecodeCounter, greedy_accept, rejection_sample

# Target p and draft q over 8 tokens, far apart: total variation 0.5.
P = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
Q = torch.tensor([0.05, 0.05, 0.10, 0.30, 0.25, 0.05, 0.10, 0.10])
P2 = torch.tensor([0.02, 0.08, 0.05, 0.10, 0.10, 0.15, 0.20, 0.30])  # the next row's target
NUM_DRAWS = 12_000
# The empirical distribution of NUM_DRAWS draws from 8 categories is within ~0.01 (TV) of the
# truth; 0.03 leaves a wide margin while tv(P, Q) = 0.5 is far outside it.
TV_BOUND = 0.03


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def test_greedy_accept_takes_the_longest_matching_prefix_then_the_targets_token() -> None:
    assert greedy_accept([5, 6, 7], [5, 6, 7, 8]) == ([5, 6, 7, 8], 3)  # all accepted + bonus
    assert greedy_accept([5, 6, 7], [5, 9, 7, 8]) == ([5, 9], 1)  # correction at the mismatch
    assert greedy_accept([5, 6, 7], [4, 6, 7, 8]) == ([4], 0)
    assert greedy_accept([], [3]) == ([3], 0)
    with pytest.raises(ValueError, match="k \\+ 1"):
        greedy_accept([1, 2], [1, 2])


def draw_first_tokens(accept_rule: str, seed: int = 0) -> tuple[torch.Tensor, float]:
    """Counts [8] of the first emitted token over NUM_DRAWS one-draft steps, and the acceptance
    rate; the draft is drawn from Q. `accept_rule`: "rejection" (the real one) or "always"."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(Q, NUM_DRAWS, replacement=True, generator=g).tolist()
    counts = torch.zeros(8)
    accepted = 0
    target, draft = torch.stack([P, P2]), Q[None]
    for x in drafts:
        if accept_rule == "always":
            tokens, num_accepted = [x], 1
        else:
            tokens, num_accepted = rejection_sample([x], target, draft, g)
        counts[tokens[0]] += 1
        accepted += num_accepted
    return counts, accepted / NUM_DRAWS


def test_rejection_sampling_emits_the_target_distribution() -> None:
    counts, acceptance = draw_first_tokens("rejection")
    assert total_variation(counts, P) < TV_BOUND
    # accepted with probability sum_x min(p(x), q(x)) = 1 - tv(p, q) = 0.5
    assert abs(acceptance - float(torch.minimum(P, Q).sum())) < 0.02


def test_the_check_rejects_a_wrong_acceptance_rule() -> None:
    """Accepting every draft emits q, not p: the same bound must fail, so the test above can."""
    counts, _ = draw_first_tokens("always")
    assert total_variation(counts, P) > TV_BOUND
    assert total_variation(counts, Q) < TV_BOUND


def test_later_tokens_follow_their_own_rows_and_the_bonus_token_follows_the_last_row() -> None:
    """Two drafts: given that the first was accepted, the second emitted token follows p_1; after
    both are accepted the bonus follows p_2."""
    g = torch.Generator().manual_seed(1)
    p3 = torch.softmax(torch.arange(8, dtype=torch.float32) * 0.3, dim=0)
    target, draft = torch.stack([P, P2, p3]), torch.stack([Q, Q])
    second, bonus = torch.zeros(8), torch.zeros(8)
    for _ in range(NUM_DRAWS):
        x = torch.multinomial(Q, 2, replacement=True, generator=g).tolist()
        tokens, num_accepted = rejection_sample(x, target, draft, g)
        assert tokens[:num_accepted] == x[:num_accepted] and len(tokens) == num_accepted + 1
        if len(tokens) >= 2:
            second[tokens[1]] += 1
        if num_accepted == 2:
            bonus[tokens[2]] += 1
    assert total_variation(second, P2) < 2 * TV_BOUND  # ~half the draws get that far
    assert bonus.sum() > 500 and total_variation(bonus, p3) < 3 * TV_BOUND


def test_rejection_sampling_is_reproducible_with_a_seeded_generator() -> None:
    target, draft = torch.stack([P, P2, P]), torch.stack([Q, Q])
    runs = [
        [rejection_sample([3, 4], target, draft, g) for _ in range(50)]
        for g in (torch.Generator().manual_seed(9), torch.Generator().manual_seed(9))
    ]
    assert runs[0] == runs[1]


def test_equal_target_and_draft_accept_every_draft() -> None:
    g = torch.Generator().manual_seed(2)
    target = torch.stack([Q, Q, P])
    for _ in range(200):
        x = torch.multinomial(Q, 2, replacement=True, generator=g).tolist()
        tokens, num_accepted = rejection_sample(x, target, torch.stack([Q, Q]), g)
        assert num_accepted == 2 and tokens[:2] == x


def test_one_hot_distributions_reduce_to_the_greedy_rule() -> None:
    """Greedy p and q (one-hot) make rejection sampling the greedy rule: a draft is accepted
    exactly when it is the target's argmax."""
    eye = torch.eye(8)
    target_ids, draft_ids = [2, 5, 7], [2, 4]
    tokens, num_accepted = rejection_sample(
        draft_ids, eye[target_ids], eye[draft_ids], torch.Generator().manual_seed(0)
    )
    assert (tokens, num_accepted) == greedy_accept(draft_ids, target_ids)


def test_filters_shape_the_distribution_both_sides_use() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]])
    probs = filtered_probs(logits, [SamplingParams(temperature=0.7, top_k=3)], [[0]])
    assert torch.count_nonzero(probs).item() == 3  # token 0 banned, then the 3 best survive
    assert probs[0, 0] == 0 and abs(float(probs.sum()) - 1.0) < 1e-6
    assert probs[0, 1] > probs[0, 2] > probs[0, 3] > 0


def test_counter_reports_acceptance_per_position_and_mean_length() -> None:
    counter = SpecDecodeCounter(3)
    counter.record(3, 3)  # 4 tokens
    counter.record(3, 1)  # 2 tokens
    counter.record(2, 0)  # 1 token (only 2 drafts fit)
    counter.record(0, 0)  # no drafts: not a verify step
    stats = counter.stats()
    assert stats.num_verify_steps == 3
    assert stats.num_draft_tokens == 8 and stats.num_accepted_tokens == 4
    assert stats.num_drafts_per_position == (3, 3, 2)
    assert stats.num_accepted_per_position == (2, 1, 1)
    assert stats.acceptance_rate_per_position == (2 / 3, 1 / 3, 1 / 2)
    assert stats.acceptance_rate == 0.5
    assert stats.mean_accepted_length == 7 / 3
    with pytest.raises(ValueError):
        counter.record(2, 3)
