"""`KVReceiver`: the decode rank's part of the engine loop (runs in the engine thread).

Reserve holds blocks under a lease (`core.ReservationBook`). A reservation is admitted into the
batch (`EngineCore.kv_arrived`) once both the NIXL notification (request id) and the Decode call
(first token) are in, in either order; the lease runs out otherwise, the blocks go back and a
waiting Decode call gets DeadlineExceeded. `on_event(kind, request_id)` runs on the event loop for
"ready" (KV arrived), "consumed" (admitted), "expired" and "cancelled" (reservation aborted).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pdmesh.engine.sampling import SamplingParams
from pdmesh.engine.scheduler import StepOutput
from pdmesh.services.common.errors import DeadlineExceeded, ResourceExhausted
from pdmesh.services.common.logging import get_logger
from pdmesh.services.decode.core import Reservation, ReservationBook
from pdmesh.services.worker.engine_loop import KV_RECEIVED_BYTES, LEASE_EXPIRIES, EngineLoop, RequestStream

log = get_logger(__name__)


class KVReceiver:
    def __init__(self, loop: EngineLoop, on_event: Callable[[str, str], None] | None = None) -> None:
        self.loop, self.on_event = loop, on_event
        self.book = ReservationBook()
        self._waiters: dict[str, tuple[asyncio.Future, RequestStream]] = {}   # Decode calls awaiting KV
        loop.role = self

    # ----- asyncio side -----
    async def reserve(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                      lease_s: float) -> list[int]:
        """Reserve blocks for a prompt prefilled elsewhere; ResourceExhausted if the pool is short."""
        return await self.loop.submit(self._reserve, list(prompt_ids), params, request_id, lease_s)

    async def admit(self, request_id: str, first_token_id: int | None) -> RequestStream:
        """Wait for the reservation's KV, then admit it; the stream carries the tokens after the first.
        DeadlineExceeded if the lease runs out first, NotFound if there is no such reservation."""
        return await self.loop.submit(self._admit_call, request_id, first_token_id, deferred=True)

    # ----- engine thread -----
    def _reserve(self, prompt_ids: list[int], params: SamplingParams, request_id: str, lease_s: float) -> list[int]:
        blocks = self.loop.engine.reserve(prompt_ids, params, request_id)
        if blocks is None:
            raise ResourceExhausted(f"not enough free KV blocks for a {len(prompt_ids)}-token prompt")
        self.book.add(Reservation(request_id, len(blocks), len(prompt_ids)), time.monotonic() + lease_s)
        return blocks

    def _admit_call(self, future: asyncio.Future, request_id: str, first_token_id: int | None) -> None:
        reservation = self.book.decode_called(request_id, first_token_id)
        self._waiters[request_id] = (future, RequestStream(request_id, reservation.num_prompt_tokens))
        if reservation.admissible:
            self._admit(reservation)

    def _admit(self, reservation: Reservation) -> None:
        request_id = reservation.request_id
        self.book.pop(request_id)
        future, stream = self._waiters.pop(request_id)
        output = self.loop.engine.kv_arrived(request_id, reservation.first_token_id)
        if output is not None:            # the first token already ended the request
            self.loop.deliver([(stream, output)])
        else:
            self.loop.streams[request_id] = stream
        self.loop.emit(self.on_event, "consumed", request_id)
        self.loop.resolve(future, stream)

    def is_busy(self) -> bool:
        return len(self.book) > 0

    def poll(self) -> None:
        if not self.book:
            return
        for request_id in self.loop.agent.notifications():
            self._kv_arrived(request_id)
        for reservation in self.book.expire(time.monotonic()):
            self._expired(reservation.request_id)

    def _kv_arrived(self, request_id: str) -> None:
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

    def _expired(self, request_id: str) -> None:
        self.loop.engine.abort(request_id)
        self.loop.stats.lease_expiries += 1
        LEASE_EXPIRIES.labels(instance=self.loop.instance_id).inc()
        log.warning("reservation lease expired before the KV arrived", request_id=request_id)
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None:
            self.loop.resolve(waiter[0], error=DeadlineExceeded(
                f"the KV of request {request_id} did not arrive within its lease"))
        self.loop.emit(self.on_event, "expired", request_id)

    def take(self, output: StepOutput) -> bool:
        return False

    def abort(self, request_id: str) -> tuple[bool, bool]:
        if self.book.pop(request_id) is None:
            return False, False
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None:            # the Decode call ends with an aborted chunk
            future, stream = waiter
            self.loop.deliver([(stream, stream.aborted_output())])
            self.loop.resolve(future, stream)
        self.loop.emit(self.on_event, "cancelled", request_id)
        return True, False

    def fail_all(self, error: BaseException) -> set[str]:
        for future, _ in self._waiters.values():
            self.loop.resolve(future, error=error)
        self._waiters.clear()
        for request_id in self.book.request_ids():
            self.book.pop(request_id)
        return set()
