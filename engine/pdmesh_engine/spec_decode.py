"""Speculative decoding's pure parts: the acceptance rules and the acceptance statistics.

A decoding request verifies k drafts d_1..d_k per step: the target runs its last token x_p plus the
drafts in one forward and yields k + 1 next-token distributions p_0..p_k (row i predicts the token
after d_i, row 0 the token after x_p). The rules below turn them into the tokens the step emits:
the accepted drafts, then one token of the target's own (the correction at the first rejection, or
the bonus token after k accepted drafts). So a step emits between 1 and k + 1 tokens.

- `greedy_accept`: the longest prefix of drafts equal to the target's argmax, then the target's
  argmax at the first mismatch: exactly the tokens plain greedy decoding would emit.
- `rejection_sample`: speculative (rejection) sampling (Leviathan et al. 2023; Chen et al. 2023):
  draft d_i, drawn from the draft's distribution q_{i-1}, is accepted with probability
  min(1, p_{i-1}(d_i) / q_{i-1}(d_i)); at the first rejection the step's last token is drawn from
  norm(max(0, p - q)) of that row, and after k acceptances the bonus token from p_k. Every emitted
  token then follows the target's distribution p exactly, whatever q is (q only changes how many
  tokens a step emits). p and q must both be the *filtered* distributions (temperature, top-k/p,
  min-p, bans) the request samples from.

No model and no device state: functions of tensors and a caller's generator. `SpecDecodeStats` is
what the engine reports (`EngineCore.spec_decode_stats`).

Legend: k drafts verified, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def greedy_accept(draft_ids: Sequence[int], target_ids: Sequence[int]) -> tuple[list[int], int]:
    """(emitted tokens, number of accepted drafts) for k drafts and the k + 1 target argmaxes."""
    if len(target_ids) != len(draft_ids) + 1:
        raise ValueError(
            f"need k + 1 target tokens for k drafts: {len(target_ids)} for {len(draft_ids)}"
        )
    num_accepted = 0
    while num_accepted < len(draft_ids) and draft_ids[num_accepted] == target_ids[num_accepted]:
        num_accepted += 1
    return list(target_ids[: num_accepted + 1]), num_accepted


def rejection_sample(
    draft_ids: Sequence[int],
    target_probs: torch.Tensor,  # [k + 1, V] p_0..p_k, rows sum to 1
    draft_probs: torch.Tensor,  # [k, V] q_0..q_{k-1}: d_{i+1} was drawn from row i
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """(emitted tokens, number of accepted drafts); see the module docstring.

    Draws k uniforms and then one [V] Exp(1) vector from `generator` (the last token is drawn by
    the exponential race argmax(weights / Exp(1)), as the sampler draws), so the same inputs and
    generator state always give the same tokens.
    """
    k = len(draft_ids)
    if target_probs.shape[0] != k + 1 or draft_probs.shape[0] != k:
        raise ValueError(
            f"need k + 1 target rows and k draft rows for k={k}: got "
            f"{target_probs.shape[0]} and {draft_probs.shape[0]}"
        )
    device = target_probs.device
    uniforms = torch.rand(k, generator=generator, device=device)
    noise = torch.empty(target_probs.shape[1], device=device).exponential_(generator=generator)
    num_accepted = k
    if k:
        ids = torch.tensor(list(draft_ids), device=device).unsqueeze(1)  # [k, 1]
        p_x = target_probs[:k].float().gather(1, ids).squeeze(1)  # [k]
        q_x = draft_probs.float().gather(1, ids).squeeze(1)  # [k]
        # u < p / q, written without the division (q = 0: accept exactly when p > 0)
        rejected = (uniforms * q_x >= p_x).nonzero()
        if rejected.numel():
            num_accepted = int(rejected[0, 0])
    weights = target_probs[num_accepted].float()
    if num_accepted < k:
        residual = (weights - draft_probs[num_accepted].float()).clamp_min_(0.0)
        if float(residual.sum()) > 0.0:  # p == q up to rounding: rejection had probability ~0
            weights = residual
    token = int((weights / noise.clamp_min_(torch.finfo(torch.float32).tiny)).argmax())
    return [*draft_ids[:num_accepted], token], num_accepted


@dataclass(frozen=True, slots=True)
class SpecDecodeStats:
    """Acceptance of drafts since the engine started. A "verify step" is one request's step that
    verified at least one draft; the counters per position are indexed by the draft's position in
    its step (0 = the first draft)."""

    num_verify_steps: int
    num_draft_tokens: int  # drafts verified
    num_accepted_tokens: int  # drafts accepted
    num_emitted_tokens: int  # tokens the verify steps produced (accepted drafts + 1 each)
    num_drafts_per_position: tuple[int, ...]  # [K]
    num_accepted_per_position: tuple[int, ...]  # [K]

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / verified drafts (0.0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_position(self) -> tuple[float, ...]:
        """[K] accepted / verified drafts at each position (0.0 where none was verified)."""
        return tuple(
            a / d if d else 0.0
            for a, d in zip(
                self.num_accepted_per_position, self.num_drafts_per_position, strict=True
            )
        )

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (1 + accepted drafts on average; 0.0 before any)."""
        return self.num_emitted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0


class SpecDecodeCounter:
    """Accumulates `SpecDecodeStats` from each verify step's outcome."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_verify_steps = self.num_draft_tokens = 0
        self.num_accepted_tokens = self.num_emitted_tokens = 0
        self.drafts_at = [0] * num_speculative_tokens
        self.accepted_at = [0] * num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One request's step that verified `num_drafts` drafts and accepted the first
        `num_accepted` (it emitted num_accepted + 1 tokens); a step without drafts is not
        counted."""
        if not num_drafts:
            return
        if not 0 <= num_accepted <= num_drafts <= len(self.drafts_at):
            raise ValueError(f"bad verify outcome: {num_accepted} of {num_drafts} drafts accepted")
        self.num_verify_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        for i in range(num_drafts):
            self.drafts_at[i] += 1
            self.accepted_at[i] += i < num_accepted

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_verify_steps,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            self.num_emitted_tokens,
            tuple(self.drafts_at),
            tuple(self.accepted_at),
        )
