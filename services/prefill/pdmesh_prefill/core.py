"""What a prefill rank decides without touching a socket: the first-token sampling parameters, the
target's checks, which local blocks go to which remote blocks, and a push's state machine.

A push (one prompt whose KV goes to a decode rank's reserved blocks):

    COMPUTING → CLAIMING | CANCELLED
    CLAIMING  → CLAIMED | REJECTED | CANCELLED
    CLAIMED   → WRITING | CANCELLED
    WRITING   → WRITTEN | FAILED

- COMPUTING: the prompt runs; the engine holds its blocks (they stay held once it is computed).
- CLAIMING: the hand-off moves RESERVED → TRANSFERRING (compare-and-set); until the answer is in,
  the move may have applied.
- CLAIMED: the hand-off is TRANSFERRING and ours: this rank, and only it, may write.
- WRITING: ONE NIXL WRITE is posted (notification = request id); it is never cut short, and the
  engine thread releases the blocks when it ends (DONE → WRITTEN, else FAILED).
- REJECTED: the claim found the reservation ended (expired, cancelled, gone): no WRITE, and the
  record is not ours to change. CANCELLED: ended before any WRITE (error, caller gone, no answer).

The WRITE is posted only from CLAIMED. `END_ACTIONS` says what each ending owes: which hand-off
states this rank may move to CANCELLED from (never while a WRITE of its may be in flight: decode
frees its blocks at once on a CANCELLED it did not cause), and whether the engine still holds the
blocks (the ending must abort the request to free them).

The prompt's KV lies in the first ceil(prompt_len / block_size) blocks the request holds
(prefix-cached blocks included, in token order); they go to the same number of leading target
blocks, every layer.

Speculative decoding: a rank that speculates keeps the proposer's KV (the MTP layer's or the draft
model's) in a second pool on the same block ids, and the push writes those blocks of both pools in
the one WRITE, so decode proposes from its first step. Both ranks must run the same proposer
(`EngineCore.speculative`, carried by the target): `check_speculation` refuses a hand-off between
ranks that differ (a decode rank expecting proposer KV is never paired silently with a prefill rank
that computes none, nor the other way round).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.transfer.layout import PoolLayout
from pdmesh_service.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    Unavailable,
)
from pdmesh_service.handoff import HandoffState, Moved, MoveOutcome, Unknown, state_found

_S = HandoffState


def prefill_params(params: SamplingParams) -> SamplingParams:
    """Sample only the first token (EOS/stop ids stay banned for it if min_tokens asks so)."""
    return replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


def kv_bytes(num_blocks: int, num_layers: int, block_bytes: int) -> int:
    """Bytes of `num_blocks` blocks across every layer of a pool."""
    return num_blocks * num_layers * block_bytes


@dataclass(frozen=True)
class PushTarget:
    """Where a prompt's KV goes: a peer agent, its pool's layout and its reserved blocks."""

    agent_name: str
    layout: PoolLayout
    block_ids: tuple[int, ...]
    draft_layout: PoolLayout | None = None  # the decode rank's proposer pool (speculation on)
    speculative: str = ""  # the decode rank's `EngineCore.speculative` ("": off)


def _speculation(setting: str) -> str:
    return f"speculative decoding {setting!r}" if setting else "no speculative decoding"


def check_speculation(target: PushTarget, speculative: str, draft: PoolLayout | None) -> None:
    """FailedPrecondition unless the target rank runs the same proposer as this one (`speculative`,
    with its pool `draft`) and its proposer pool holds the same blocks."""
    same = "the KV hand-off carries the proposer's KV, so prefill and decode ranks must be started "
    same += "with the same --speculative-method (and --draft-model)"
    if target.speculative != speculative:
        raise FailedPrecondition(
            f"decode rank {target.agent_name} runs {_speculation(target.speculative)} and this "
            f"prefill rank {_speculation(speculative)}: {same}"
        )
    if (draft is None) != (target.draft_layout is None):
        has = "has no" if target.draft_layout is None else "has a"
        raise FailedPrecondition(
            f"decode rank {target.agent_name} {has} proposer KV pool, unlike this prefill rank "
            f"(both run {_speculation(speculative)}): {same}"
        )
    if draft is not None and target.draft_layout is not None:
        try:
            draft.check_compatible(target.draft_layout)
        except ValueError as e:
            raise FailedPrecondition(
                f"the proposer pool of {target.agent_name} does not match this one: {e}"
            ) from e


def check_target(target: PushTarget, local: PoolLayout, num_prompt_tokens: int) -> int:
    """Number of blocks to push. FailedPrecondition if the target pool holds other blocks than this
    one; InvalidArgument if it reserved fewer blocks than the prompt needs."""
    try:
        local.check_compatible(target.layout)
    except ValueError as e:
        raise FailedPrecondition(
            f"target pool of {target.agent_name} does not match this pool: {e}"
        ) from e
    needed = num_blocks_for(num_prompt_tokens, local.block_size)
    if len(target.block_ids) < needed:
        raise InvalidArgument(
            f"the target reserved {len(target.block_ids)} blocks; the prompt's "
            f"{num_prompt_tokens} tokens need {needed} blocks of "
            f"{local.block_size}"
        )
    return needed


def plan_push(
    num_prompt_tokens: int, block_size: int, local_block_ids: list[int], target: PushTarget
) -> tuple[list[int], list[int]]:
    """(local block ids, remote block ids) of the prompt, pairwise, in token order."""
    needed = num_blocks_for(num_prompt_tokens, block_size)
    if len(target.block_ids) < needed:
        raise InvalidArgument(
            f"the target reserved {len(target.block_ids)} blocks, the prompt needs {needed}"
        )
    if len(local_block_ids) < needed:
        raise RuntimeError(
            f"the request holds {len(local_block_ids)} blocks, its prompt needs {needed}"
        )
    return list(local_block_ids[:needed]), list(target.block_ids[:needed])


# ----- a push's state machine -----
class PushState(enum.Enum):
    COMPUTING = "computing"
    CLAIMING = "claiming"
    CLAIMED = "claimed"
    WRITING = "writing"
    WRITTEN = "written"
    FAILED = "failed"
    REJECTED = "rejected"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return not PUSH_TRANSITIONS[self]


_P = PushState
PUSH_TRANSITIONS: dict[PushState, frozenset[PushState]] = {
    _P.COMPUTING: frozenset({_P.CLAIMING, _P.CANCELLED}),
    _P.CLAIMING: frozenset({_P.CLAIMED, _P.REJECTED, _P.CANCELLED}),
    _P.CLAIMED: frozenset({_P.WRITING, _P.CANCELLED}),
    _P.WRITING: frozenset({_P.WRITTEN, _P.FAILED}),  # a WRITE in flight is never cut short
    _P.WRITTEN: frozenset(),
    _P.FAILED: frozenset(),
    _P.REJECTED: frozenset(),
    _P.CANCELLED: frozenset(),
}


@dataclass(frozen=True)
class EndAction:
    """What ending a push owes. `cancel_from`: the hand-off states this rank may move to CANCELLED
    from (empty: leave the record); `owns_blocks`: the engine still holds the prompt's blocks for
    this push, so the ending aborts the request to free them (False: the engine thread released
    them when the WRITE ended); `forget_peer`: drop the peer's cached metadata (reload it next
    time)."""

    cancel_from: tuple[HandoffState, ...] = ()
    owns_blocks: bool = False
    forget_peer: bool = False


END_ACTIONS: dict[tuple[PushState, PushState], EndAction] = {
    (_P.COMPUTING, _P.CANCELLED): EndAction((_S.RESERVED,), owns_blocks=True),
    # no answer to the claim: it may have applied, and TRANSFERRING would then be ours, unwritten
    (_P.CLAIMING, _P.CANCELLED): EndAction((_S.RESERVED, _S.TRANSFERRING), owns_blocks=True),
    (_P.CLAIMING, _P.REJECTED): EndAction((), owns_blocks=True),
    (_P.CLAIMED, _P.CANCELLED): EndAction((_S.TRANSFERRING,), owns_blocks=True),
    (_P.WRITING, _P.FAILED): EndAction((_S.TRANSFERRING,), forget_peer=True),
    (_P.WRITING, _P.WRITTEN): EndAction(),
}


@dataclass(slots=True)
class PushFlow:
    """Where one push stands (asyncio side); `advance` enforces PUSH_TRANSITIONS."""

    request_id: str
    peer: str  # the target's agent name
    state: PushState = PushState.COMPUTING

    def advance(self, new: PushState) -> EndAction | None:
        """Move to `new`; returns what the ending owes when `new` is final (None otherwise).
        FailedPrecondition for a move not in PUSH_TRANSITIONS."""
        if new not in PUSH_TRANSITIONS[self.state]:
            raise FailedPrecondition(
                f"push of {self.request_id} cannot go from {self.state.name} to {new.name}"
            )
        old, self.state = self.state, new
        return END_ACTIONS[(old, new)] if new.is_final else None


def after_claim(outcome: MoveOutcome) -> PushState:
    """Where a push goes once its claim (RESERVED → TRANSFERRING) answered: CLAIMED if this call
    moved it; CANCELLED when there is no answer (the claim may have applied); REJECTED otherwise
    (the reservation ended first: expired, cancelled or gone)."""
    if isinstance(outcome, Moved):
        return PushState.CLAIMED
    if isinstance(outcome, Unknown):
        return PushState.CANCELLED
    return PushState.REJECTED


def claim_error(request_id: str, outcome: MoveOutcome) -> MeshError:
    """The caller's error for a claim that did not make the push CLAIMED."""
    if isinstance(outcome, Unknown):
        return Unavailable(
            f"cannot claim the hand-off of {request_id} in the kvstore: {outcome.reason}"
        )
    found = state_found(outcome)
    why = f"its hand-off is {found.name}" if found is not None else "it has no hand-off record"
    return Aborted(
        f"the decode reservation of request {request_id} ended before the KV was ready ({why})"
    )
