"""What a prefill rank decides without touching a socket: the first-token sampling parameters, which
local blocks go to which remote blocks, and the bookkeeping of pushes in flight.

Contract of a push: it is posted only once the prompt is computed AND the hand-off was claimed
(RESERVED → TRANSFERRING in the kvstore), never otherwise. The prompt's KV lies in the first
ceil(prompt_len / block_size) blocks the request holds (prefix-cached blocks included, in token order);
they are written to the same number of leading target blocks, every layer, in ONE NIXL WRITE whose
notification is the request id.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.scheduler import StepOutput
from pdmesh_service.errors import InvalidArgument


def prefill_params(params: SamplingParams) -> SamplingParams:
    """Sample only the first token (EOS/stop ids stay banned for it if min_tokens asks so)."""
    return replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def check_prompt(prompt_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """The engine's own admission checks, done before any side effect (InvalidArgument)."""
    if not prompt_ids:
        raise InvalidArgument("the prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if len(prompt_ids) >= max_model_len:
        raise InvalidArgument(f"the prompt has {len(prompt_ids)} tokens; this engine's context is {max_model_len} "
                              "tokens (prompt plus at least one output token)")


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


def kv_bytes(num_blocks: int, num_layers: int, block_bytes: int) -> int:
    """Bytes of `num_blocks` blocks across every layer of a pool."""
    return num_blocks * num_layers * block_bytes


@dataclass(frozen=True)
class PushTarget:
    """Where a prompt's KV goes: a peer agent, its pool layout (transfer.PoolLayout) and its blocks."""

    agent_name: str
    layout: Any
    block_ids: tuple[int, ...]


def check_target(num_prompt_tokens: int, block_size: int, target: PushTarget) -> int:
    """Number of blocks to push; InvalidArgument if the target reserved fewer."""
    needed = num_blocks_for(num_prompt_tokens, block_size)
    if len(target.block_ids) < needed:
        raise InvalidArgument(f"the target reserved {len(target.block_ids)} blocks; the prompt's "
                              f"{num_prompt_tokens} tokens need {needed} blocks of {block_size}")
    return needed


def plan_push(num_prompt_tokens: int, block_size: int, local_blocks: list[int],
              target: PushTarget) -> tuple[list[int], list[int]]:
    """(local block ids, remote block ids) of the prompt, pairwise."""
    needed = check_target(num_prompt_tokens, block_size, target)
    if len(local_blocks) < needed:
        raise RuntimeError(f"the request holds {len(local_blocks)} blocks, its prompt needs {needed}")
    return list(local_blocks[:needed]), list(target.block_ids[:needed])


@dataclass(slots=True)
class Push:
    """One prefill whose KV goes to a peer: computing, then computed (blocks held, waiting for the
    hand-off to be claimed), then in flight once its WRITE is posted."""

    request_id: str
    waiter: Any                        # the current phase's future (owned by the engine loop), or None
    target: PushTarget | None = None   # set when the WRITE is asked for
    transfer: Any = None               # the agent's transfer handle once the WRITE is posted
    step: StepOutput | None = None     # the finished prefill step (first token)
    started: float = 0.0
    num_bytes: int = 0

    @property
    def computed(self) -> bool:
        return self.step is not None

    @property
    def in_flight(self) -> bool:
        return self.transfer is not None


class PeerSet:
    """Names of the NIXL peers this agent has loaded metadata for."""

    def __init__(self) -> None:
        self._names: set[str] = set()

    def add(self, name: str) -> None:
        self._names.add(name)

    def discard(self, name: str) -> None:
        self._names.discard(name)

    def __contains__(self, name: object) -> bool:
        return name in self._names
