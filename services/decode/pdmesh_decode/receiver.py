"""`KVReceiver`: the decode rank's part of the engine loop (runs in the engine thread).

Reserve holds blocks (`core.ReservationBook`); `publish` (once the kvstore hand-off is open) starts the
lease. A reservation is admitted into the batch (`EngineCore.kv_arrived`) once both the NIXL
notification (request id) and the Decode call (first token) are in, in either order.

Its lease running out does not end it by itself ("expired" event → `decide`): if the kvstore says a
prefill rank claimed its hand-off (TRANSFERRING/READY, or unknown), or its KV is in already, it waits
for the rest until `quarantine_s` (the cap) and then proceeds normally; only when the cap passes too is
it dropped ("lapsed" event: its record is ended first, then `decide` drops it). If no prefill rank
claimed it (RESERVED → EXPIRED) it ends at once. Dropped: blocks freed, a waiting Decode call gets
DeadlineExceeded.

Cancelled (the call ends with an aborted chunk) before admission, it ends:
- not published yet (no prefill rank knows its blocks), or its KV already arrived: blocks freed at once;
- else quarantined: the blocks stay out of the pool until `settle(request_id, free=True)` (the kvstore
  says no WRITE can land), its NIXL notification arrives, or `quarantine_s` passes, whichever is first.
A quarantined request id cannot be reserved again meanwhile (Unavailable).

`on_event(kind, request_id)` runs on the event loop for "ready" (KV arrived), "consumed" (admitted),
"expired" (lease ran out: end the hand-off if unclaimed, then `decide`), "cancelled" (end its hand-off,
then `settle`) and "lapsed" (the cap passed: end its hand-off, then `decide` to drop it).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import torch

from pdmesh_engine.request import Request
from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.scheduler import StepOutput
from pdmesh_service.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from pdmesh_service.logging import get_logger
from pdmesh_decode.core import LeaseTable, Reservation, ReservationBook
from pdmesh_service.worker.engine_loop import (KV_QUARANTINES, KV_RECEIVED_BYTES, LEASE_EXPIRIES, EngineLoop,
                                                RequestStream)

log = get_logger(__name__)
DEFAULT_QUARANTINE_S = 30.0


def skip_first_draw(request: Request, vocab_size: int) -> None:
    """Advance a seeded, sampled request's generator past the draw prefill made for its first token, so
    decode's next draw is the one offline would make. Contract with `pdmesh_engine.sampler`: every
    sample of a non-greedy row draws exactly one [V] float32 Exp(1) vector from the row's generator."""
    generator = request.generator
    if generator is None or request.sampling_params.is_greedy:
        return
    torch.empty(vocab_size, dtype=torch.float32, device=generator.device).exponential_(generator=generator)


class KVReceiver:
    def __init__(self, loop: EngineLoop, on_event: Callable[[str, str], None] | None = None,
                 quarantine_s: float = DEFAULT_QUARANTINE_S) -> None:
        self.loop, self.on_event, self.quarantine_s = loop, on_event, quarantine_s
        self.book = ReservationBook()
        self.quarantine = LeaseTable()     # ended reservations whose blocks a WRITE may still land in → cap
        self._waiters: dict[str, tuple[asyncio.Future, RequestStream]] = {}   # Decode calls awaiting KV
        loop.role = self

    # ----- asyncio side -----
    async def reserve(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> list[int]:
        """Reserve blocks for a prompt prefilled elsewhere; ResourceExhausted if the pool is short,
        Unavailable if the id is quarantined. The lease starts at `publish`."""
        return await self.loop.submit(self._reserve, list(prompt_ids), params, request_id)

    async def publish(self, request_id: str, lease_s: float) -> bool:
        """The hand-off is open: start the lease; False if the reservation was aborted meanwhile."""
        return await self.loop.submit(self._publish, request_id, lease_s)

    async def admit(self, request_id: str, first_token_id: int | None) -> RequestStream:
        """Wait for the reservation's KV, then admit it; the stream carries the tokens after the first.
        DeadlineExceeded if it ends first (lease out with no prefill claim, or the cap passed), NotFound if
        there is no such reservation."""
        return await self.loop.submit(self._admit_call, request_id, first_token_id, deferred=True)

    async def decide(self, request_id: str, wait: bool) -> None:
        """The kvstore answered for a reservation whose lease ran out: `wait` for its KV until the cap (a
        prefill rank claimed its hand-off), or end it now (none did, and none can any more)."""
        await self.loop.submit(self._decide, request_id, wait)

    async def settle(self, request_id: str, free: bool) -> None:
        """The hand-off of an ended reservation is recorded: `free` its blocks now, or keep the quarantine."""
        await self.loop.submit(self._settle, request_id, free)

    # ----- engine thread -----
    def _reserve(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> list[int]:
        if request_id in self.quarantine:
            raise Unavailable(f"request id {request_id!r} is quarantined here (a KV write into its previous "
                              "blocks may still land); reserve it on another rank or later")
        blocks = self.loop.engine.reserve(prompt_ids, params, request_id)
        if blocks is None:
            raise ResourceExhausted(f"not enough free KV blocks for a {len(prompt_ids)}-token prompt")
        self.book.add(Reservation(request_id, len(blocks), len(prompt_ids)))
        self.loop.stats.requests_total += 1
        return blocks

    def _publish(self, request_id: str, lease_s: float) -> bool:
        return self.book.publish(request_id, time.monotonic() + lease_s)

    def _admit_call(self, future: asyncio.Future, request_id: str, first_token_id: int | None) -> None:
        reservation = self.book.decode_called(request_id, first_token_id)
        self._waiters[request_id] = (future, RequestStream(request_id, reservation.num_prompt_tokens))
        if reservation.admissible:
            self._admit(reservation)

    def _admit(self, reservation: Reservation) -> None:
        request_id, engine = reservation.request_id, self.loop.engine
        self.book.pop(request_id)
        future, stream = self._waiters.pop(request_id)
        if reservation.first_token_id is not None:      # prefill sampled it: its draw is spent
            skip_first_draw(engine.scheduler.requests[request_id], self.loop.vocab_size)
        output = engine.kv_arrived(request_id, reservation.first_token_id)
        if output is not None:            # the first token already ended the request
            self.loop.deliver([(stream, output)])
        else:
            self.loop.streams[request_id] = stream
        self.loop.emit(self.on_event, "consumed", request_id)
        self.loop.resolve(future, stream)

    def is_busy(self) -> bool:
        return len(self.book) > 0 or len(self.quarantine) > 0

    def poll(self) -> None:
        if not self.is_busy():
            return
        for request_id in self.loop.agent.notifications():
            self._kv_arrived(request_id)
        now = time.monotonic()
        for reservation in self.book.lapsed(now):
            self._lease_ran_out(reservation)
        for request_id in self.quarantine.expired(now):
            log.warning("quarantine cap passed without the KV notification; blocks freed", request_id=request_id)
            self.loop.engine.abort(request_id)

    def _kv_arrived(self, request_id: str) -> None:
        if self.quarantine.remove(request_id):       # the late WRITE landed: nothing can write there any more
            log.info("KV of an ended reservation arrived; quarantined blocks freed", request_id=request_id)
            self.loop.engine.abort(request_id)
            return
        reservation = self.book.kv_arrived(request_id)
        if reservation is None:
            log.warning("KV notification for no reservation (expired or aborted)", request_id=request_id)
            return
        layout = self.loop.agent.layout            # the WRITE filled every layer of the reserved blocks
        received = reservation.num_blocks * layout.num_layers * layout.block_bytes
        self.loop.stats.kv_bytes_received += received
        KV_RECEIVED_BYTES.labels(instance=self.loop.instance_id).inc(received)
        self.loop.emit(self.on_event, "ready", request_id)
        if reservation.admissible:
            self._admit(reservation)

    def _lease_ran_out(self, reservation: Reservation) -> None:
        """The lease: wait at once if the KV is in, else ask the kvstore ("expired" → `decide`). The cap:
        "lapsed" (the kvstore record is ended, then `decide` drops it). A lease nobody was told of: drop."""
        request_id = reservation.request_id
        if not reservation.published:
            self._drop(reservation)
            return
        if reservation.extended:
            log.warning("the KV did not arrive within the cap; dropping the request", request_id=request_id,
                        cap_s=self.quarantine_s)
            reservation.lapsed = True
            self.loop.emit(self.on_event, "lapsed", request_id)
            return
        self.loop.stats.lease_expiries += 1
        LEASE_EXPIRIES.labels(instance=self.loop.instance_id).inc()
        if reservation.kv_ready:                    # claimed and written: only the Decode call is missing
            self._wait_past_lease(reservation)
            return
        reservation.lapsed = True
        self.loop.emit(self.on_event, "expired", request_id)

    def _decide(self, request_id: str, wait: bool) -> None:
        reservation = self.book.get(request_id)
        if reservation is None or not reservation.lapsed:      # admitted, aborted or replaced meanwhile
            return
        if wait and not reservation.extended:
            self._wait_past_lease(reservation)
            return
        if not reservation.extended:
            log.warning("reservation lease expired before any prefill claimed it", request_id=request_id)
        self._drop(reservation)

    def _wait_past_lease(self, reservation: Reservation) -> None:
        log.info("lease ran out while the KV is on its way; waiting up to the cap", cap_s=self.quarantine_s,
                 request_id=reservation.request_id, kv_ready=reservation.kv_ready)
        self.book.extend(reservation.request_id, time.monotonic() + self.quarantine_s)

    def _drop(self, reservation: Reservation) -> None:
        """End it for good: free its blocks and fail a waiting Decode call."""
        request_id = reservation.request_id
        self.book.pop(request_id)
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None:
            self.loop.resolve(waiter[0], error=DeadlineExceeded(
                f"the KV of request {request_id} did not arrive within its lease (or the cap, once claimed)"))
        self.loop.engine.abort(request_id)

    def _end(self, reservation: Reservation, kind: str) -> None:
        """A reservation cancelled before admission: free its blocks, or quarantine them until `settle`."""
        request_id = reservation.request_id
        if reservation.published and not reservation.kv_ready:
            self.quarantine.add(request_id, time.monotonic() + self.quarantine_s)
        else:
            self.loop.engine.abort(request_id)
        if reservation.published:
            self.loop.emit(self.on_event, kind, request_id)

    def _settle(self, request_id: str, free: bool) -> None:
        if not free:                      # counted even if the KV landed meanwhile (the blocks were kept)
            self.loop.stats.kv_quarantines += 1
            KV_QUARANTINES.labels(instance=self.loop.instance_id).inc()
            log.warning("reservation ended while a KV write into it may be in flight; blocks quarantined",
                        request_id=request_id, still_held=request_id in self.quarantine, cap_s=self.quarantine_s)
        elif self.quarantine.remove(request_id):
            self.loop.engine.abort(request_id)

    def take(self, output: StepOutput) -> bool:
        return False

    def abort(self, request_id: str) -> tuple[bool, bool]:
        reservation = self.book.pop(request_id)
        if reservation is None:           # quarantined blocks are never freed by an abort
            return False, request_id in self.quarantine
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None:            # the Decode call ends with an aborted chunk
            future, stream = waiter
            self.loop.deliver([(stream, stream.aborted_output())])
            self.loop.resolve(future, stream)
        self._end(reservation, "cancelled")
        return True, True

    def fail_all(self, error: BaseException) -> set[str]:
        for future, _ in self._waiters.values():
            self.loop.resolve(future, error=error)
        self._waiters.clear()
        for request_id in self.book.request_ids():
            self.book.pop(request_id)
        return set(self.quarantine.request_ids())
