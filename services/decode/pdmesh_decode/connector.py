"""`DecodeConnector`: the decode rank's side of the KV hand-off, in one place.

One reservation, start to end (every decision is `core.decide`; this class carries the actions out):

    Reserve  → `reserve`: the engine holds blocks (HELD) → kvstore `open_handoff` (RESERVED) → the
               lease starts (PUBLISHED) → block ids, owned by the reservation until it is
               admitted, dropped or cancelled
    NIXL notification (engine thread, `poll`) → digest check (`--kv-digest`) → KV_ARRIVED →
               kvstore READY; a mismatch → KV_REJECTED → REJECT (below)
    Decode   → `admit`: DECODE_CALLED; with both in, ADMIT: the engine takes the request and its
               blocks (`EngineCore.kv_arrived`) → kvstore CONSUMED → the Decode call gets its
               stream
    deadline (engine thread, `poll`) → DEADLINE → ASK_KVSTORE: RESERVED → EXPIRED (`expire_handoff`)
               → KV_MAY_ARRIVE (claimed: wait until the cap) or KV_WONT_ARRIVE (DROP); at the cap,
               END_CLAIMED: claimed → EXPIRED → KV_WONT_ARRIVE (DROP: blocks freed, the call fails)
    Cancel / caller gone → `abort` (engine thread) → CANCELLED → FREE, END_AND_FREE or QUARANTINE;
               the record is ended CANCELLED (`end_handoff`) and the state it was ended from says
               whether quarantined blocks go back at once (`handoff.may_be_written`); `cancel`
               answers after that

Threads: methods named `_on_*` and the `EngineRole` hooks (`is_busy`, `poll`, `take`, `abort`,
`fail_all`) run in the engine thread and are the only ones that touch the engine, the book and the
quarantine; they hand kvstore work to the event loop with `loop.post`. The coroutines talk to the
kvstore (compare-and-set with bounded retries, `kvstore_client.move_handoff`) and bring its answers
back with `loop.submit`. A kvstore answer carries the reservation's serial, so it never applies to a
later reservation under the same id.

Quarantine: the blocks of a reservation cancelled while a WRITE may still land stay out of the pool
until the WRITE's notification arrives, the kvstore says none can land, or `cap_s` passes; its
request id cannot be reserved again meanwhile (Unavailable).

KV integrity (`pdmesh_engine.transfer.digest`): the notification carries the sender's digest of the
bytes it wrote; before KV_ARRIVED this rank digests the same bytes in its blocks. A mismatch (or a
missing digest where this rank's mode requires one) fails closed: counted
(`pdmesh_kv_digest_mismatches_total`), the reservation ends (REJECT: a waiting Decode call gets
`KVDigestMismatch`, NOT_FOUND, which the gateway retries from the start like any lost hand-off),
its blocks are quarantined, never admitted nor cached, until the record is ended CANCELLED (the
notification proves nothing more can land), then freed.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from pdmesh_decode.core import (
    Arrived,
    Decision,
    KVDigestMismatch,
    LeaseAction,
    LeaseTable,
    Reservation,
    ReservationBook,
    ReservationEvent,
    ReservationState,
)
from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.scheduler import StepOutput
from pdmesh_engine.transfer.digest import DigestMode, Notice, is_digested
from pdmesh_engine.transfer.layout import handoff_nbytes
from pdmesh_service.errors import DeadlineExceeded, MeshError, ResourceExhausted, Unavailable
from pdmesh_service.handoff import HandoffState, Moved, kv_may_still_arrive, may_be_written
from pdmesh_service.kvstore_client import HandoffRecords, end_handoff, expire_handoff, move_handoff
from pdmesh_service.logging import get_logger
from pdmesh_service.tasks import Background
from pdmesh_service.worker.engine_loop import EngineLoop
from pdmesh_service.worker.stream import RequestStream, feed, settle

if TYPE_CHECKING:
    from pdmesh_engine.transfer.agent import KVTransferAgent

log = get_logger(__name__)
DEFAULT_QUARANTINE_S = 30.0
_REJECTED_KEPT = 1024  # rejected ids remembered, so a late Decode call learns why
_CLAIMED = (HandoffState.TRANSFERRING, HandoffState.READY)


class HandoffStore(HandoffRecords, Protocol):
    """What the connector needs of the kvstore (`KVStoreClient`)."""

    async def open_handoff(
        self, request_id: str, decode_instance: str, num_blocks: int, lease_ms: int
    ) -> object: ...


class DecodeConnector:
    def __init__(
        self,
        loop: EngineLoop,
        agent: KVTransferAgent,
        kvstore: HandoffStore,
        instance_id: str,
        cap_s: float = DEFAULT_QUARANTINE_S,
        clock: Callable[[], float] = time.monotonic,
        digest: DigestMode = "off",
    ) -> None:
        """`digest`: the `--kv-digest` mode (which hand-offs must arrive with a matching digest)."""
        self.loop, self.agent, self.kvstore, self.instance_id = loop, agent, kvstore, instance_id
        self.cap_s, self.clock, self.digest = cap_s, clock, digest
        self.book = ReservationBook()
        # cancelled reservations whose blocks a WRITE may still land in → cap
        self.quarantine = LeaseTable()
        # Decode calls
        self._waiters: dict[str, tuple[asyncio.Future[RequestStream], RequestStream]] = {}
        self._serials = itertools.count(1)
        self._background = Background()
        # records being ended CANCELLED, for `cancel`
        self._ending: dict[str, asyncio.Task[Any]] = {}
        self._reports: asyncio.Queue[tuple[str, HandoffState, HandoffState]] | None = None
        self._rejected: dict[str, None] = {}  # the last ids whose KV failed its digest check

    # ----- event loop: what the servicer calls -----
    async def reserve(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, lease_ms: int
    ) -> dict[str, list[int]]:
        """Hold blocks, open the hand-off, start the lease; the block ids to write the KV into, by
        KV group. ResourceExhausted (pool short), Unavailable (id quarantined, kvstore down,
        aborted meanwhile)."""
        try:
            tables: dict[str, list[int]]
            tables, serial = await self.loop.submit(
                self._on_reserve, list(prompt_ids), params, request_id, lease_ms / 1000.0
            )
            await self._open_handoff(request_id, len(next(iter(tables.values()))), lease_ms)
            if not await self.loop.submit(self._on_publish, request_id, serial):
                await self._move(request_id, HandoffState.CANCELLED, (HandoffState.RESERVED,))
                raise Unavailable(
                    f"the reservation of request {request_id} was aborted while it was being made"
                )
            return tables
        except asyncio.CancelledError:
            self.loop.abort_soon(request_id)
            raise

    async def admit(self, request_id: str, first_token_id: int | None) -> RequestStream:
        """Wait for the KV, then admit; the stream carries the tokens after the first.
        DeadlineExceeded if the reservation is dropped first, NotFound if there is none,
        FailedPrecondition for a second call."""
        try:
            stream: RequestStream = await self.loop.submit(
                self._on_call, request_id, first_token_id, deferred=True
            )
            return stream
        except asyncio.CancelledError:
            self.loop.abort_soon(request_id)
            raise

    async def cancel(self, request_id: str) -> bool:
        """Abort the request; for a reservation, answer once its record is ended and its blocks
        settled."""
        found = await self.loop.abort(request_id)
        ending = self._ending.get(request_id)  # posted before the abort's answer: known here
        if ending is not None:
            await asyncio.shield(ending)
        return found

    async def close(self) -> None:
        await self._background.close()

    # ----- engine thread: the EngineRole hooks -----
    def is_busy(self) -> bool:
        return len(self.book) > 0 or len(self.quarantine) > 0

    def poll(self) -> None:
        if not self.is_busy():
            return
        for notice in self.agent.arrivals():
            self._on_kv(notice)
        now = self.clock()
        for request_id in self.book.due(now):
            reservation = self.book.get(request_id)
            if reservation is not None and reservation.state is ReservationState.PUBLISHED:
                self.loop.metrics.lease_expired()  # the lease, not the cap
            self._carry_out(self.book.apply(request_id, ReservationEvent.DEADLINE, now))
        for request_id in self.quarantine.expired(now):
            log.warning(
                "quarantine cap passed without the KV notification; blocks freed",
                request_id=request_id,
            )
            self.loop.engine.abort(request_id)

    def take(self, output: StepOutput) -> bool:
        return False

    def abort(self, request_id: str) -> tuple[bool, bool]:
        """(found, the connector frees or quarantines the blocks itself); quarantined blocks
        stay."""
        if request_id not in self.book:
            return False, request_id in self.quarantine
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None:  # the Decode call ends with an aborted chunk
            future, stream = waiter
            self.loop.post(feed, [(stream, stream.aborted_output())])
            self.loop.post(settle, future, stream)
        self._carry_out(self.book.apply(request_id, ReservationEvent.CANCELLED, self.clock()))
        return True, True

    def fail_all(self, error: BaseException) -> set[str]:
        for future, _ in self._waiters.values():
            self.loop.post(settle, future, None, error)
        self._waiters.clear()
        for request_id in self.book.request_ids():
            self.book.pop(request_id)
        return set(self.quarantine.request_ids())

    # ----- engine thread: commands and events -----
    def _on_reserve(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, lease_s: float
    ) -> tuple[dict[str, list[int]], int]:
        if request_id in self.quarantine:
            raise Unavailable(
                f"request id {request_id!r} is quarantined here (a KV write into its previous "
                "blocks may still land); reserve it on another rank or later"
            )
        tables = self.loop.engine.reserve(prompt_ids, params, request_id)
        if tables is None:
            raise ResourceExhausted(
                f"not enough free KV blocks for a {len(prompt_ids)}-token prompt"
            )
        serial = next(self._serials)
        self._rejected.pop(request_id, None)
        num_blocks = len(next(iter(tables.values())))
        self.book.add(
            Reservation(request_id, num_blocks, len(prompt_ids), lease_s, self.cap_s, serial)
        )
        self.loop.metrics.request_taken()
        return tables, serial

    def _on_publish(self, request_id: str, serial: int) -> bool:
        """Start the lease; False if the reservation is gone (aborted while its record was
        opened)."""
        if not self._is_current(request_id, serial):
            return False
        self._carry_out(self.book.apply(request_id, ReservationEvent.PUBLISHED, self.clock()))
        return True

    def _on_call(
        self, future: asyncio.Future[RequestStream], request_id: str, first_token_id: int | None
    ) -> None:
        if request_id in self._rejected and request_id not in self.book:
            raise _mismatch_error(request_id)
        decision = self.book.apply(
            request_id, ReservationEvent.DECODE_CALLED, self.clock(), first_token_id
        )
        reservation = decision.reservation
        self._waiters[request_id] = (
            future,
            RequestStream(request_id, reservation.num_prompt_tokens),
        )
        self._carry_out(decision)

    def _on_kv(self, notice: Notice) -> None:
        request_id = notice.request_id
        # the late WRITE landed: nothing can write there any more
        if self.quarantine.remove(request_id):
            log.info(
                "KV of an ended reservation arrived; quarantined blocks freed",
                request_id=request_id,
            )
            self.loop.engine.abort(request_id)
            return
        reservation = self.book.get(request_id)
        if reservation is None or Arrived.KV in reservation.arrived:
            log.warning(
                "KV notification for no waiting reservation (expired or aborted)",
                request_id=request_id,
            )
            return
        # the WRITE filled every layer of the blocks each KV group needs (the proposer's too)
        sizes = handoff_nbytes(self.agent.groups, reservation.num_prompt_tokens)
        mismatch = self._check_digest(reservation, notice.digest)
        if mismatch is not None:
            self.loop.metrics.kv_digest_mismatch()
            log.error(
                "KV digest mismatch: the hand-off fails closed; its blocks are quarantined",
                request_id=request_id,
                kv_bytes=sum(sizes.values()),
                **mismatch,
            )
            self._carry_out(self.book.apply(request_id, ReservationEvent.KV_REJECTED, self.clock()))
            return
        self.loop.metrics.kv_received(sum(sizes.values()), sizes.get("draft", 0))
        self._report(request_id, HandoffState.READY, HandoffState.TRANSFERRING)
        self._carry_out(self.book.apply(request_id, ReservationEvent.KV_ARRIVED, self.clock()))

    def _check_digest(self, reservation: Reservation, sent: int | None) -> dict[str, str] | None:
        """None when the KV may be admitted; else what was wrong (for the log)."""
        if self.digest == "off" or (
            sent is None and not is_digested(self.digest, reservation.request_id)
        ):
            return None
        if sent is None:
            return {"why": f"no digest came with it (--kv-digest {self.digest} requires one)"}
        tables = self.loop.engine.kv_tables(reservation.request_id)
        found = self.agent.handoff_digest(tables, reservation.num_prompt_tokens)
        if found == sent:
            return None
        return {"why": "the bytes differ", "sent": f"{sent:016x}", "found": f"{found:016x}"}

    def _on_answer(self, request_id: str, serial: int, event: ReservationEvent) -> None:
        """The kvstore answered ASK_KVSTORE or END_CLAIMED (ignored if the reservation moved on
        meanwhile)."""
        if not self._is_current(request_id, serial):
            return
        self._carry_out(self.book.apply(request_id, event, self.clock()))

    def _on_ended(self, request_id: str, ended_from: HandoffState | None) -> None:
        """A QUARANTINE's record is ended: free the blocks unless a WRITE may still land in them."""
        # counted even if the KV landed meanwhile (the blocks were kept)
        if may_be_written(ended_from):
            self.loop.metrics.kv_quarantined()
            log.warning(
                "reservation ended while a KV write into it may be in flight; blocks quarantined",
                request_id=request_id,
                still_held=request_id in self.quarantine,
                cap_s=self.cap_s,
            )
        elif self.quarantine.remove(request_id):
            self.loop.engine.abort(request_id)

    def _is_current(self, request_id: str, serial: int) -> bool:
        reservation = self.book.get(request_id)
        return reservation is not None and reservation.serial == serial

    # ----- engine thread: carrying out a decision -----
    def _carry_out(self, decision: Decision) -> None:
        reservation, action = decision.reservation, decision.action
        request_id, serial = reservation.request_id, reservation.serial
        if action is LeaseAction.ADMIT:
            self._admit(reservation)
        elif action is LeaseAction.WAIT and reservation.state is ReservationState.EXTENDED:
            log.info(
                "lease ran out while the KV is on its way; waiting up to the cap",
                request_id=request_id,
                cap_s=self.cap_s,
                kv_ready=Arrived.KV in reservation.arrived,
            )
        elif action is LeaseAction.ASK_KVSTORE:
            self.loop.post(self._spawn, self._expire, request_id, serial)
        elif action is LeaseAction.END_CLAIMED:
            log.warning(
                "the KV did not arrive within the cap; dropping the request",
                request_id=request_id,
                cap_s=self.cap_s,
            )
            self.loop.post(self._spawn, self._lapse, request_id, serial)
        elif action is LeaseAction.DROP:
            self._drop(reservation)
        elif action in (LeaseAction.FREE, LeaseAction.END_AND_FREE):
            self.loop.engine.abort(request_id)
        elif action is LeaseAction.REJECT:
            self._fail_waiter(request_id)
        if action in (LeaseAction.QUARANTINE, LeaseAction.REJECT) and decision.until is not None:
            self.quarantine.add(request_id, decision.until)
        if action in (LeaseAction.END_AND_FREE, LeaseAction.QUARANTINE, LeaseAction.REJECT):
            self.loop.post(self._start_end, request_id, action)

    def _admit(self, reservation: Reservation) -> None:
        """The engine takes the request and its blocks; the Decode call gets its stream."""
        request_id = reservation.request_id
        future, stream = self._waiters.pop(request_id)
        output = self.loop.engine.kv_arrived(request_id, reservation.first_token_id)
        if output is not None:  # the first token already ended the request
            self.loop.post(feed, [(stream, output)])
        else:
            self.loop.attach(stream)
        self._report(request_id, HandoffState.CONSUMED, HandoffState.READY)
        self.loop.post(settle, future, stream)

    def _drop(self, reservation: Reservation) -> None:
        """Free the blocks and fail a waiting Decode call."""
        request_id = reservation.request_id
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None:
            self.loop.post(
                settle,
                waiter[0],
                None,
                DeadlineExceeded(
                    f"the KV of request {request_id} did not arrive within its lease (or the cap, "
                    "once claimed)"
                ),
            )
        self.loop.engine.abort(request_id)

    def _fail_waiter(self, request_id: str) -> None:
        """REJECT: a waiting Decode call fails (the gateway retries from the start)."""
        self._rejected[request_id] = None
        while len(self._rejected) > _REJECTED_KEPT:
            del self._rejected[next(iter(self._rejected))]
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None:
            self.loop.post(settle, waiter[0], None, _mismatch_error(request_id))

    def _on_released(self, request_id: str) -> None:
        """A REJECT's record is ended: its WRITE had landed, so nothing more can; free the
        blocks."""
        if self.quarantine.remove(request_id):
            self.loop.engine.abort(request_id)

    def _report(self, request_id: str, state: HandoffState, expected: HandoffState) -> None:
        self.loop.post(self._queue_report, request_id, state, expected)

    # ----- event loop: kvstore work -----
    def _spawn(self, work: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        self._background.spawn(work(*args))

    def _start_end(self, request_id: str, action: LeaseAction) -> None:
        task = self._background.spawn(self._end(request_id, action))
        self._ending[request_id] = task
        task.add_done_callback(
            lambda t: self._ending.pop(request_id) if self._ending.get(request_id) is t else None
        )

    async def _end(self, request_id: str, action: LeaseAction) -> None:
        ended_from = await end_handoff(self.kvstore, request_id, HandoffState.CANCELLED)
        if action is LeaseAction.QUARANTINE:
            await self._answer(self._on_ended, request_id, ended_from)
        elif action is LeaseAction.REJECT:  # even unknown: the notification proved the WRITE ended
            await self._answer(self._on_released, request_id)

    async def _expire(self, request_id: str, serial: int) -> None:
        claimed = kv_may_still_arrive(await expire_handoff(self.kvstore, request_id))
        event = ReservationEvent.KV_MAY_ARRIVE if claimed else ReservationEvent.KV_WONT_ARRIVE
        if not claimed:
            log.warning(
                "reservation lease expired before any prefill claimed it", request_id=request_id
            )
        await self._answer(self._on_answer, request_id, serial, event)

    async def _lapse(self, request_id: str, serial: int) -> None:
        # Only from the claimed states: a RESERVED record would be a retry's (the gateway retries
        # once the reservation is dropped, which is why it is dropped only after this).
        await self._move(request_id, HandoffState.EXPIRED, _CLAIMED)
        await self._answer(self._on_answer, request_id, serial, ReservationEvent.KV_WONT_ARRIVE)

    async def _answer(self, on_engine: Callable[..., None], *args: Any) -> None:
        try:
            await self.loop.submit(on_engine, *args)
        except Exception as e:  # noqa: BLE001 - the engine stopped: its blocks are gone with it
            log.warning("cannot apply a kvstore answer", answer=on_engine.__name__, error=str(e))

    async def _move(
        self, request_id: str, to: HandoffState, expected: tuple[HandoffState, ...]
    ) -> None:
        """A best-effort move (the record lapses by itself if it fails); its outcome is logged."""
        outcome = await move_handoff(self.kvstore, request_id, to, expected)
        if not isinstance(outcome, Moved):
            log.info(
                "hand-off not moved", request_id=request_id, state=to.name, outcome=repr(outcome)
            )

    def _queue_report(self, request_id: str, state: HandoffState, expected: HandoffState) -> None:
        """READY and CONSUMED go to the kvstore one at a time, in the order the engine thread saw
        them."""
        if self._reports is None:
            self._reports = asyncio.Queue()
            self._background.spawn(self._send_reports(self._reports))
        self._reports.put_nowait((request_id, state, expected))

    async def _send_reports(
        self, reports: asyncio.Queue[tuple[str, HandoffState, HandoffState]]
    ) -> None:
        while True:
            request_id, state, expected = await reports.get()
            await self._move(request_id, state, (expected,))

    async def _open_handoff(self, request_id: str, num_blocks: int, lease_ms: int) -> None:
        try:
            await self.kvstore.open_handoff(request_id, self.instance_id, num_blocks, lease_ms)
        except BaseException as e:
            self.loop.abort_soon(request_id)
            if isinstance(e, (MeshError, asyncio.CancelledError)):
                raise
            raise Unavailable(f"cannot record the hand-off in the kvstore: {e}") from e


def _mismatch_error(request_id: str) -> KVDigestMismatch:
    return KVDigestMismatch(
        f"the KV of request {request_id} failed its digest check on arrival; the hand-off failed "
        "and its blocks were quarantined (retry the request: it gets a new hand-off)"
    )
