"""`EngineLoop`: the one thread that owns an `EngineCore` (and the rank's NIXL agent), driven from asyncio.

The engine is not thread-safe: only this thread touches it. asyncio code submits commands through
a thread-safe queue and awaits their results (resolved with `loop.call_soon_threadsafe`); each
request's outputs flow into its own `RequestStream` (an `asyncio.Queue` fed from the thread).

Loop body: drain commands → role poll (NIXL notifications and transfers, lease expiry) → `step()`
if the engine has work → deliver outputs. With no work it blocks on the command queue:
`BUSY_WAIT_S` while the role waits on NIXL (KV expected, WRITE in flight), `IDLE_WAIT_S` otherwise.

DEP rank (`engine.lockstep` set): every iteration calls `step()`, a collective every rank of the
instance runs in the same sequence (commands only change local state). After a step that ran no
forward on any rank, the next sync waits `IDLE_SYNC_MIN_S`, doubling up to `IDLE_SYNC_MAX_S`, or less
once this rank has work; commands run and the role is polled (every `BUSY_WAIT_S` while busy) in between.
`stop()` asks every rank to stop after the next step; a step that fails (a rank died, a collective timed
out) or another rank's stop ends the loop too, and `ended` tells why.

The role (`EngineRole`) adds what differs between ranks and runs in this thread too: decode's
`KVReceiver` (reservations, leases, admission on the KV notification), prefill's `KVPusher` (one
NIXL WRITE per finished prompt). Blocks a WRITE reads are never released before it ends, and blocks a
WRITE may still land in stay out of the pool (decode's quarantine) until it did or a cap passed.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from prometheus_client import Counter, Gauge, Histogram

from pdmesh_engine.engine_core import EngineCore
from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.scheduler import StepOutput
from pdmesh_service.errors import Unavailable
from pdmesh_service.logging import get_logger
from pdmesh_service.worker.stream import RequestStream

log = get_logger(__name__)
IDLE_WAIT_S = 0.1
BUSY_WAIT_S = 0.001
IDLE_SYNC_MIN_S, IDLE_SYNC_MAX_S = 0.001, 0.02     # DEP: pause before a sync that follows an idle one

_L = ("instance",)
KV_TRANSFER_BYTES = Counter("pdmesh_kv_transfer_bytes_total", "KV bytes written to other agents over NIXL", _L)
KV_TRANSFER_SECONDS = Histogram("pdmesh_kv_transfer_seconds", "Duration of one NIXL KV WRITE", _L,
                                buckets=(1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0))
KV_TRANSFER_FAILURES = Counter("pdmesh_kv_transfer_failures_total", "NIXL KV transfers that failed", _L)
KV_RECEIVED_BYTES = Counter("pdmesh_kv_received_bytes_total", "KV bytes other agents wrote into this pool", _L)
LEASE_EXPIRIES = Counter("pdmesh_lease_expiries_total", "Reservations whose lease ran out before the KV", _L)
KV_QUARANTINES = Counter("pdmesh_kv_quarantines_total",
                         "Ended reservations whose blocks stayed out of the pool while a KV write could land", _L)
KV_BLOCKS_USED = Gauge("pdmesh_kv_blocks_used", "KV blocks held by requests", _L)
KV_BLOCKS_FREE = Gauge("pdmesh_kv_blocks_free", "KV blocks free or evictable", _L)
REQUESTS_RUNNING = Gauge("pdmesh_requests_running", "Requests in the running batch", _L)
REQUESTS_WAITING = Gauge("pdmesh_requests_waiting", "Requests waiting to run or for KV", _L)


@dataclass
class WorkerStats:
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    transfer_failures: int = 0
    lease_expiries: int = 0
    kv_quarantines: int = 0
    requests_total: int = 0         # requests this rank took (Generate, Reserve, Prefill)


@dataclass(frozen=True)
class EngineStatus:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    stats: WorkerStats
    integrity_checked: bool = False
    integrity_error: str = ""
    rank: int = 0
    dp_size: int = 1
    expert_weight_bytes: int = 0


@dataclass(slots=True)
class _Command:
    fn: Callable[..., Any]
    args: tuple
    future: asyncio.Future | None
    deferred: bool = False      # fn(future, *args) resolves the future itself, maybe later


_STOP = object()
StreamItem = tuple[RequestStream, StepOutput | BaseException]


class EngineRole(Protocol):
    """What a rank adds to the loop; every method runs in the engine thread."""

    def is_busy(self) -> bool:
        """Whether NIXL must be polled often (KV expected, a WRITE in flight)."""
        ...

    def poll(self) -> None:
        """Poll NIXL notifications and transfers, expire leases."""
        ...

    def take(self, output: StepOutput) -> bool:
        """Consume a step output that is not streamed (True), or leave it to the streams."""
        ...

    def abort(self, request_id: str) -> tuple[bool, bool]:
        """Forget the request: (found, the role frees its blocks itself: NIXL may still read or write them)."""
        ...

    def fail_all(self, error: BaseException) -> set[str]:
        """Fail every waiter; returns the ids whose blocks NIXL may still read or write."""
        ...


class EngineLoop:
    def __init__(self, engine: EngineCore, agent: Any = None, instance_id: str = "", rank: int = 0,
                 dp_size: int = 1) -> None:
        self.engine, self.agent, self.instance_id = engine, agent, instance_id
        self.rank, self.dp_size = rank, dp_size
        self.expert_weight_bytes = engine.runner.expert_weight_bytes()
        self.role: EngineRole | None = None
        self.stats = WorkerStats()
        self.streams: dict[str, RequestStream] = {}          # engine thread only
        self._commands: queue.SimpleQueue[_Command | object] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.ended: asyncio.Future[str] | None = None      # set when the thread ends: why
        self._end_reason = "stopped"

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size      # immutable: safe to read from any thread

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # ----- asyncio side -----
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.ended = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.instance_id}", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort every request, fail every waiter, and end the thread."""
        if self._thread is not None:
            self._commands.put(_STOP)
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def submit(self, fn: Callable[..., Any], *args: Any, deferred: bool = False) -> asyncio.Future:
        """Run `fn(*args)` in the engine thread; the future gets its result or error. A `deferred`
        command is called as `fn(future, *args)` and resolves the future itself (maybe later)."""
        if self._thread is None or not self._thread.is_alive():     # a DEP rank's loop can end on its own
            raise Unavailable("the engine loop is not running")
        future = self._loop.create_future()
        self._commands.put(_Command(fn, args, future, deferred))
        return future

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        stream = RequestStream(request_id, len(prompt_ids))
        await self.submit(self._generate, list(prompt_ids), params, request_id, stream)
        return stream

    async def connect(self, peer_name: str, metadata: bytes) -> None:
        """Load a peer agent's metadata (the agent, like the engine, is used from this thread only)."""
        await self.submit(self.agent.connect, peer_name, metadata)

    async def abort(self, request_id: str) -> bool:
        return await self.submit(self._abort, request_id)

    def abort_soon(self, request_id: str) -> None:
        """Abort without waiting (from callbacks and `finally` blocks); a no-op if unknown or stopped."""
        if self._thread is not None:
            self._commands.put(_Command(self._abort, (request_id,), None))

    async def status(self, check_integrity: bool = False) -> EngineStatus:
        return await self.submit(self._status, check_integrity)

    # ----- engine thread: what roles use -----
    def resolve(self, future: asyncio.Future | None, value: Any = None, error: BaseException | None = None) -> None:
        if future is not None:
            self._call_soon(_settle, future, value, error)

    def deliver(self, items: list[StreamItem]) -> None:
        if items:
            self._call_soon(_put_all, items)

    def emit(self, callback: Callable[..., Any] | None, *args: Any) -> None:
        """Run `callback(*args)` on the event loop."""
        if callback is not None:
            self._call_soon(callback, *args)

    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:      # the event loop is closed: nobody is waiting any more
            pass

    # ----- engine thread: the loop -----
    def _run(self) -> None:
        try:
            if self.engine.lockstep is not None:
                self._run_lockstep()
            else:
                self._run_single()
        except BaseException as e:  # noqa: BLE001 - the thread must not die silently
            log.exception("engine loop crashed", instance=self.instance_id)
            self._end_reason = f"engine loop crashed: {type(e).__name__}: {e}"
        finally:
            self._fail_all(Unavailable("the worker is shutting down"))
            self._drain_after_stop()
            self.resolve(self.ended, self._end_reason)

    def _run_single(self) -> None:
        while self._drain(self._wait_s()):
            if self.role is not None:
                self.role.poll()
            if self.engine.has_unfinished:
                self._step()

    def _run_lockstep(self) -> None:
        """DEP: one collective step per iteration until a rank stops (see the module docstring)."""
        lockstep, idle_s, stopping = self.engine.lockstep, 0.0, False
        while True:
            if not stopping and not self._pause(idle_s):
                stopping = True
                lockstep.request_stop()
            self._deliver_outputs(self.engine.step())      # raises when the group broke: the loop ends
            record = lockstep.last
            if record.stop:
                self._end_reason = "stopped" if stopping else "another rank of this DEP instance stopped"
                return
            idle_s = 0.0 if record.ran_forward else min(max(2 * idle_s, IDLE_SYNC_MIN_S), IDLE_SYNC_MAX_S)

    def _pause(self, wait_s: float) -> bool:
        """DEP, between syncs: run commands and poll the role for up to `wait_s` (NIXL every `BUSY_WAIT_S`
        while the role is busy), less once this rank has work. False once asked to stop."""
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            busy = self.role is not None and self.role.is_busy()
            if not self._drain(max(0.0, min(left, BUSY_WAIT_S) if busy else left)):
                return False
            if self.role is not None:
                self.role.poll()
            if left <= 0 or self.engine.has_unfinished:
                return True

    def _wait_s(self) -> float:
        if self.engine.has_unfinished:
            return 0.0
        return BUSY_WAIT_S if self.role is not None and self.role.is_busy() else IDLE_WAIT_S

    def _drain(self, timeout: float) -> bool:
        """Run queued commands (waiting up to `timeout` for the first); False once asked to stop."""
        try:
            command = self._commands.get(timeout=timeout) if timeout > 0 else self._commands.get_nowait()
        except queue.Empty:
            return True
        while command is not _STOP:
            self._execute(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _execute(self, command: _Command) -> None:
        try:
            if command.deferred:
                command.fn(command.future, *command.args)
            else:
                self.resolve(command.future, command.fn(*command.args))
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            if command.future is None:
                log.exception("engine command failed", command=command.fn.__name__)
            self.resolve(command.future, error=e)

    def _drain_after_stop(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Command):
                self.resolve(command.future, error=Unavailable("the worker is shutting down"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - every request of this engine fails with it
            log.exception("engine step failed", instance=self.instance_id)
            self._fail_all(Unavailable(f"engine step failed: {type(e).__name__}: {e}"))
            return
        self._deliver_outputs(outputs)

    def _deliver_outputs(self, outputs: list[StepOutput]) -> None:
        items: list[StreamItem] = []
        for output in outputs:
            if self.role is not None and self.role.take(output):
                continue
            stream = self.streams.get(output.request_id)
            if stream is not None:
                items.append((stream, output))
                if output.finish_reason is not None:
                    del self.streams[output.request_id]
        self.deliver(items)

    # ----- engine thread: commands -----
    def _generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                  stream: RequestStream) -> None:
        self.engine.add_request(prompt_ids, params, request_id)
        self.streams[request_id] = stream
        self.stats.requests_total += 1

    def _abort(self, request_id: str) -> bool:
        found, busy = self.role.abort(request_id) if self.role is not None else (False, False)
        if busy:                  # NIXL may still use the blocks: the role frees them when that is over
            return True
        found = self.engine.abort(request_id) or found
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            self.deliver([(stream, stream.aborted_output())])
        return found

    def _status(self, check_integrity: bool) -> EngineStatus:
        error = ""
        if check_integrity:
            try:
                self.engine.check_integrity()
            except AssertionError as e:
                error = str(e) or "the KV pool's integrity check failed"
        kv, scheduler = self.engine.kv_stats(), self.engine.scheduler
        status = EngineStatus(scheduler.num_running, scheduler.num_waiting, kv.num_used, kv.num_free + kv.num_cached,
                              kv.num_blocks, replace(self.stats), check_integrity, error, self.rank, self.dp_size,
                              self.expert_weight_bytes)
        labels = {"instance": self.instance_id}
        KV_BLOCKS_USED.labels(**labels).set(status.kv_blocks_used)
        KV_BLOCKS_FREE.labels(**labels).set(status.kv_blocks_free)
        REQUESTS_RUNNING.labels(**labels).set(status.num_running)
        REQUESTS_WAITING.labels(**labels).set(status.num_waiting)
        return status

    def _fail_all(self, error: BaseException) -> None:
        """End every request with `error`; blocks NIXL still reads stay until their WRITE ends."""
        self.deliver([(stream, error) for stream in self.streams.values()])
        self.streams.clear()
        busy = self.role.fail_all(error) if self.role is not None else set()
        scheduler = self.engine.scheduler
        for request_id in [*scheduler.requests, *scheduler.held]:
            if request_id not in busy:
                self.engine.abort(request_id)


def _settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _put_all(items: list[StreamItem]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
