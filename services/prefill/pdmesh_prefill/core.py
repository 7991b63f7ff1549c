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

The prompt's KV lies in the request's blocks of each KV group (`EngineCore.kv_memory`: V3 `kv`,
V4 `full` and `window`), by logical block index, prefix-cached blocks included; each group's
blocks that the receiver's next step needs (`KVGroup.handoff_indices`: all of the prompt's, or for
V4's window only those of its last positions) go to the target's blocks of the same indices, every
pool and layer, in one WRITE. Both ranks must hold the same groups (`check_target`: a P and D whose
block size, dtype or layers differ are refused, the difference named).

Speculative decoding: a rank that speculates keeps the proposer's KV (the MTP layer's or the draft
model's) in a group of its own (`draft`) on the same block ids, and the push writes it in the one
WRITE, so decode proposes from its first step. Both ranks must run the same proposer
(`EngineCore.speculative`, carried by the target): `check_speculation` refuses a hand-off between
ranks that differ (a decode rank expecting proposer KV is never paired silently with a prefill rank
that computes none, nor the other way round).

Revisions: a target carries its rank's revision (`pdmesh_service.revision`: checkpoint, KV layout
and dtype, block size, speculative setting, KV format version); `check_revision` refuses one of
another revision than this rank's (`RevisionMismatch`, FAILED_PRECONDITION with both fingerprints
and the parts that differ). The gateway pairs only ranks of one revision; this is the fence behind
it (a gateway of an older release, a stale view during a rolling update).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.transfer.layout import KVGroup, check_groups
from pdmesh_service.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    Unavailable,
)
from pdmesh_service.handoff import HandoffState, Moved, MoveOutcome, Unknown, state_found
from pdmesh_service.revision import Revision, mismatch

_S = HandoffState


def prefill_params(params: SamplingParams) -> SamplingParams:
    """Sample only the first token (EOS/stop ids stay banned for it if min_tokens asks so)."""
    return replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


@dataclass(frozen=True)
class PushTarget:
    """Where a prompt's KV goes: a peer agent, its KV groups and its reserved blocks in each."""

    agent_name: str
    groups: tuple[KVGroup, ...]
    block_ids: Mapping[str, tuple[int, ...]]  # by group, by logical block index
    speculative: str = ""  # the decode rank's `EngineCore.speculative` ("": off)
    revision: str = ""  # the decode rank's revision fingerprint ("": not reported)
    revision_parts: Mapping[str, str] = field(default_factory=dict)  # what it hashes


class RevisionMismatch(FailedPrecondition):
    """The target rank runs another revision than this one: no hand-off between them."""


def check_revision(target: PushTarget, revision: Revision) -> None:
    """`RevisionMismatch` unless the target's revision is this rank's (the message names both
    fingerprints and the parts that differ)."""
    why = mismatch(revision.fingerprint, revision.parts, target.revision, target.revision_parts)
    if why is not None:
        raise RevisionMismatch(
            f"decode rank {target.agent_name} cannot take this prefill rank's KV: {why}"
        )


def _speculation(setting: str) -> str:
    return f"speculative decoding {setting!r}" if setting else "no speculative decoding"


def check_speculation(target: PushTarget, speculative: str) -> None:
    """FailedPrecondition unless the target rank runs the same proposer as this one."""
    if target.speculative != speculative:
        raise FailedPrecondition(
            f"decode rank {target.agent_name} runs {_speculation(target.speculative)} and this "
            f"prefill rank {_speculation(speculative)}: the KV hand-off carries the proposer's "
            "KV, so prefill and decode ranks must be started with the same "
            "--speculative-method (and --draft-model)"
        )


def check_target(target: PushTarget, local: Sequence[KVGroup], num_prompt_tokens: int) -> None:
    """FailedPrecondition if the target holds other KV groups than this rank (the difference
    named); InvalidArgument if it reserved fewer blocks than the prompt needs."""
    try:
        check_groups(local, target.groups)
    except ValueError as e:
        raise FailedPrecondition(
            f"the KV of {target.agent_name} does not match this rank's: {e}"
        ) from e
    for group in target.groups:
        needed = group.handoff_indices(num_prompt_tokens).stop
        reserved = len(target.block_ids.get(group.name, ()))
        if reserved < needed:
            raise InvalidArgument(
                f"the target reserved {reserved} blocks of KV group {group.name!r}; the "
                f"prompt's {num_prompt_tokens} tokens need {needed} blocks of {group.block_size}"
            )


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
