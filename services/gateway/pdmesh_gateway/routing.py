"""Where a prompt is computed (pure policy: no grpc, redis or asyncio).

- Prefix matches. `prompt_block_hashes` names the prompt's blocks as the engine's prefix cache does
  (chained hashes of the full blocks, from the request's cache salt, always leaving the last token
  to compute), so a prompt only matches blocks cached under its own salt; the kvstore's prefix
  index answers, per rank, how many leading blocks it holds (`cached_tokens`).
- Prefill choice (`PrefillRouting.CACHE_AWARE`). Cost of a rank = the prompt tokens it would compute
  (those it does not hold) + the tokens this gateway already gave it that are not prefilled yet
  (queued or in flight). The cheapest rank wins, so a session's next turn goes where its prefix
  is (sticky sessions fall out of this) unless that rank's queue costs more than recomputing
  the prefix on an idle rank. Ties: fewer requests in flight, then in turn.
  `LEAST_LOADED` is the policy without the index: fewest requests in flight (for comparison).
- Local prefill (conditional disaggregation, `LocalPrefill`). A prompt whose uncached part on its
  decode rank is at most the threshold is prefilled by that decode rank (`Generate`): a hand-off
  costs the decode rank less than prefilling then only when it saves more compute than its own
  overhead. `auto` sets the threshold to overhead × prefill speed, both measured on this gateway's
  hand-offs (`HandoffModel`); `off` disaggregates every prompt (as before).
- Revisions (`choose_revision`). A hand-off pairs ranks of one revision only (the fingerprint of
  what must match across it: `pdmesh_service.revision`). A request's revision is the least loaded
  decode rank's; on a tie, one that has a prefill rank up (a hand-off possible) wins, then the
  first in sorted order. A revision without a prefill rank serves on its decode ranks alone.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum

from pdmesh_engine.block_hash import BlockHash, hash_full_blocks

# Where the auto threshold starts (then it follows this gateway's hand-offs): what `HandoffModel`
# measured over 80 hand-offs of the `small` model on a 2-core CPU mesh of 1 prefill + 1 decode
# (`pdmesh bench routing --compare disagg`): 64 ms of overhead, prefill at ~1,380 tokens/s, so
# prompts of up to ~88 uncached tokens are cheaper to prefill on the decode rank.
DEFAULT_HANDOFF_OVERHEAD_S = 0.064
DEFAULT_PREFILL_TOKENS_PER_S = 1380.0
MIN_SPEED_SAMPLE_TOKENS = 256  # shorter prefills time mostly overhead: no speed sample


class PrefillRouting(StrEnum):
    CACHE_AWARE = "cache-aware"
    LEAST_LOADED = "least-loaded"

    def __str__(self) -> str:
        return self.value


class DecodeBalance(StrEnum):
    """What ranks decode ranks by: requests (running + waiting), or KV tokens held."""

    REQUESTS = "requests"
    KV_TOKENS = "kv-tokens"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class LocalPrefill:
    """The conditional-disaggregation setting: `off`, `auto` or a fixed number of tokens."""

    mode: str = "off"  # off | auto | fixed
    tokens: int = 0  # the fixed threshold

    @classmethod
    def parse(cls, text: str) -> LocalPrefill:
        value = text.strip().lower()
        if value in ("off", "auto"):
            return cls(value)
        try:
            tokens = int(value)
        except ValueError:
            raise ValueError(
                f"--local-prefill-tokens must be off, auto or a number of tokens, got {text!r}"
            ) from None
        if tokens < 0:
            raise ValueError(f"--local-prefill-tokens must be >= 0, got {tokens}")
        return cls("fixed", tokens) if tokens else cls("off")

    def __str__(self) -> str:
        return str(self.tokens) if self.mode == "fixed" else self.mode


@dataclass(frozen=True)
class RoutingConfig:
    prefill: PrefillRouting = PrefillRouting.CACHE_AWARE
    local_prefill: LocalPrefill = LocalPrefill()
    decode_balance: DecodeBalance = DecodeBalance.REQUESTS
    lookup_timeout_s: float = 0.25  # a slower prefix lookup is skipped (routing on load alone)


def prompt_block_hashes(
    prompt_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[BlockHash]:
    """The hashes under which an engine with `block_size` caches this prompt's blocks for a
    request with `cache_salt` (never the block of the last token, which it always computes)."""
    full = (len(prompt_ids) - 1) // block_size * block_size
    return hash_full_blocks(list(prompt_ids[:full]), block_size, cache_salt=cache_salt)


def cached_tokens(matched_blocks: int, block_size: int, prompt_tokens: int) -> int:
    return max(0, min(matched_blocks * block_size, prompt_tokens - 1))


@dataclass(frozen=True)
class PrefillCandidate:
    instance_id: str
    cached_tokens: int = 0  # of this prompt, in the rank's prefix cache
    queued_tokens: int = 0  # tokens this gateway gave the rank that are not prefilled yet
    in_flight: int = 0  # requests this gateway has on the rank

    def cost(self, prompt_tokens: int) -> int:
        return prompt_tokens - self.cached_tokens + self.queued_tokens


def choose_prefill(
    prompt_tokens: int, candidates: Sequence[PrefillCandidate], last: str = ""
) -> PrefillCandidate:
    """The cheapest candidate (module docstring); ties to fewer requests in flight, then to the
    first id after `last` (round robin)."""
    if not candidates:
        raise ValueError("no prefill candidate")
    best = min((c.cost(prompt_tokens), c.in_flight) for c in candidates)
    tied = sorted(
        (c for c in candidates if (c.cost(prompt_tokens), c.in_flight) == best),
        key=lambda c: c.instance_id,
    )
    return next((c for c in tied if c.instance_id > last), tied[0])


def choose_revision(
    decodes: Sequence[tuple[str, tuple[int, ...]]], prefill_revisions: Collection[str]
) -> str:
    """The revision of the least loaded decode rank among `decodes` ((revision, load) each);
    ties to a revision in `prefill_revisions` (one a hand-off can pair), then to the smallest."""
    if not decodes:
        raise ValueError("no decode candidate")
    return min(decodes, key=lambda d: (d[1], d[0] not in prefill_revisions, d[0]))[0]


def prefills_locally(uncached_tokens: int, threshold_tokens: int) -> bool:
    """Whether the decode rank prefills the prompt itself (threshold 0: never)."""
    return threshold_tokens > 0 and uncached_tokens <= threshold_tokens


class HandoffModel:
    """What a hand-off costs besides the prefill (seconds: Reserve, the KV transfer, Decode's
    admission) and how fast prefill runs (uncached tokens per second of Prefill minus its
    transfer), as moving averages of this gateway's hand-offs; `threshold_tokens` is their
    product: the prefill work a hand-off's overhead is worth."""

    def __init__(
        self,
        overhead_s: float = DEFAULT_HANDOFF_OVERHEAD_S,
        tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
        alpha: float = 0.1,
    ) -> None:
        self.overhead_s, self.tokens_per_s, self.alpha = overhead_s, tokens_per_s, alpha
        self.samples = 0
        # KV moved by the hand-offs, and the prompt tokens it was the KV of
        self.kv_bytes = self.kv_prompt_tokens = 0

    def observe(
        self,
        uncached_tokens: int,
        reserve_s: float,
        prefill_s: float,
        transfer_s: float,
        decode_s: float,
        kv_bytes: int = 0,
        prompt_tokens: int = 0,
    ) -> None:
        """One hand-off's phases as the gateway timed them (`transfer_s` and `kv_bytes`, the KV
        it moved for `prompt_tokens`, as prefill reported)."""
        self.samples += 1
        self.kv_bytes += kv_bytes
        self.kv_prompt_tokens += prompt_tokens
        overhead = max(reserve_s, 0.0) + max(transfer_s, 0.0) + max(decode_s, 0.0)
        self.overhead_s += self.alpha * (overhead - self.overhead_s)
        compute_s = prefill_s - transfer_s
        if uncached_tokens >= MIN_SPEED_SAMPLE_TOKENS and compute_s > 0:
            self.tokens_per_s += self.alpha * (uncached_tokens / compute_s - self.tokens_per_s)

    @property
    def kv_bytes_per_handoff(self) -> int | None:
        return self.kv_bytes // self.samples if self.samples else None

    @property
    def kv_bytes_per_prompt_token(self) -> float | None:
        return self.kv_bytes / self.kv_prompt_tokens if self.kv_prompt_tokens else None

    @property
    def threshold_tokens(self) -> int:
        return int(self.overhead_s * self.tokens_per_s)


def local_threshold(setting: LocalPrefill, model: HandoffModel) -> int:
    """The threshold in force: 0 (off), the fixed one, or the model's."""
    if setting.mode == "auto":
        return model.threshold_tokens
    return setting.tokens if setting.mode == "fixed" else 0
