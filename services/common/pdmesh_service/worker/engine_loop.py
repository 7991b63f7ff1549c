"""`EngineLoop`: the one thread that owns an `EngineCore` (and the rank's NIXL agent), driven from
asyncio.

The engine is not thread-safe: only this thread touches it. asyncio code submits commands through
a thread-safe queue and awaits their futures; the thread answers by one verb, `post(fn, *args)`,
which runs `fn` on the event loop (`stream.settle` resolves a future, `stream.feed` appends outputs
to their `RequestStream`s).

Loop body: drain commands → role poll (NIXL notifications and transfers, lease expiry) → `step()`
if the engine has work → deliver outputs. With no work it blocks on the command queue:
`BUSY_WAIT_S` while the role waits on NIXL (KV expected, WRITE in flight), `IDLE_WAIT_S` otherwise.

DEP rank (`engine.lockstep` set): every iteration calls `step()`, a collective every rank of the
instance runs in the same sequence (commands only change local state). After a step that ran no
forward on any rank, the next sync waits `IDLE_SYNC_MIN_S`, doubling up to `IDLE_SYNC_MAX_S`, or
less once this rank has work; commands run and the role is polled (every `BUSY_WAIT_S` while busy)
in between. `stop()` asks every rank to stop after the next step; a step that fails (a rank died, a
collective timed out) or another rank's stop ends the loop too, and `ended` tells why.

The role (`EngineRole`, given to `start`) adds what differs between ranks and runs in this thread
too: decode's `DecodeConnector` (reservations, leases, admission on the KV notification), prefill's
`KVPusher` (one NIXL WRITE per finished prompt). Blocks a WRITE reads are never released before it
ends, and blocks a WRITE may still land in stay out of the pool (decode's quarantine) until it did
or a cap passed. Counting goes through the rank's `WorkerMetrics` (constructor argument); `status()`
returns its totals.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pdmesh_engine.engine_core import EngineCore
from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.scheduler import StepOutput
from pdmesh_engine.spec_decode import SpecDecodeStats
from pdmesh_service.errors import Unavailable
from pdmesh_service.logging import get_logger
from pdmesh_service.worker.metrics import WorkerLoad, WorkerMetrics, WorkerStats
from pdmesh_service.worker.stream import RequestStream, StreamItem, feed, settle

if TYPE_CHECKING:
    from pdmesh_engine.parallel.dep import LockstepStepper
    from pdmesh_engine.transfer.agent import KVTransferAgent

log = get_logger(__name__)
IDLE_WAIT_S = 0.1
BUSY_WAIT_S = 0.001
IDLE_SYNC_MIN_S, IDLE_SYNC_MAX_S = 0.001, 0.02  # DEP: pause before a sync that follows an idle one


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
    spec_decode: SpecDecodeStats | None = None  # None: speculative decoding is off

    @property
    def load(self) -> WorkerLoad:
        return WorkerLoad(
            self.num_running, self.num_waiting, self.kv_blocks_used, self.kv_blocks_free
        )


@dataclass(slots=True)
class _Command:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any] | None
    deferred: bool = False  # fn(future, *args) resolves the future itself, maybe later


_STOP = object()


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
        """Forget the request: (found, the role frees its blocks itself: NIXL may still read or
        write them)."""
        ...

    def fail_all(self, error: BaseException) -> set[str]:
        """Fail every waiter; returns the ids whose blocks NIXL may still read or write."""
        ...


class EngineLoop:
    """The engine thread. Built by `run_worker` with the rank's metrics; its role comes with
    `start(role)`."""

    def __init__(
        self,
        engine: EngineCore,
        agent: KVTransferAgent | None = None,
        instance_id: str = "",
        rank: int = 0,
        dp_size: int = 1,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.engine, self.agent, self.instance_id = engine, agent, instance_id
        self.rank, self.dp_size = rank, dp_size
        self.metrics = metrics if metrics is not None else WorkerMetrics(instance_id)
        model_dir = getattr(engine, "model_dir", None)  # the served model's name labels vllm:*
        if model_dir is not None:
            self.metrics.serve_model(Path(model_dir).resolve().name)
        self.role: EngineRole | None = None  # given to `start`
        self.streams: dict[str, RequestStream] = {}  # engine thread only
        self._commands: queue.SimpleQueue[_Command | object] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.ended: asyncio.Future[str] | None = None  # set when the thread ends: why
        self._end_reason = "stopped"

    @property
    def vocab_size(self) -> int:
        # immutable: safe to read from any thread
        vocab_size: int = self.engine.model_config.vocab_size
        return vocab_size

    @property
    def max_model_len(self) -> int:
        max_model_len: int = self.engine.max_model_len
        return max_model_len

    # ----- asyncio side -----
    def start(self, role: EngineRole | None = None) -> None:
        """Start the thread on the running event loop; `role` (if any) runs in it from the first
        iteration."""
        self.role = role
        self._loop = asyncio.get_running_loop()
        self.ended = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._run, name=f"engine-{self.instance_id}", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        """Abort every request, fail every waiter, and end the thread."""
        if self._thread is not None:
            self._commands.put(_STOP)
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def submit(
        self, fn: Callable[..., Any], *args: Any, deferred: bool = False
    ) -> asyncio.Future[Any]:
        """Run `fn(*args)` in the engine thread; the future gets its result or error. A `deferred`
        command is called as `fn(future, *args)` and resolves the future itself (maybe later)."""
        # a DEP loop can end alone
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            raise Unavailable("the engine loop is not running")
        future = self._loop.create_future()
        self._commands.put(_Command(fn, args, future, deferred))
        return future

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> RequestStream:
        stream = RequestStream(request_id, len(prompt_ids))
        await self.submit(self._generate, list(prompt_ids), params, request_id, stream)
        return stream

    async def connect(self, peer_name: str, metadata: bytes) -> None:
        """Load a peer agent's metadata (the agent, like the engine, is used from this thread
        only)."""
        if self.agent is None:
            raise Unavailable("this engine loop has no NIXL agent")
        await self.submit(self.agent.connect, peer_name, metadata)

    async def abort(self, request_id: str) -> bool:
        found: bool = await self.submit(self._abort, request_id)
        return found

    def abort_soon(self, request_id: str) -> None:
        """Abort without waiting (from callbacks and `finally` blocks); a no-op if unknown or
        stopped."""
        if self._thread is not None:
            self._commands.put(_Command(self._abort, (request_id,), None))

    async def status(self, check_integrity: bool = False) -> EngineStatus:
        status: EngineStatus = await self.submit(self._status, check_integrity)
        return status

    # ----- engine thread: the one way back to the event loop -----
    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the event loop (e.g. `stream.settle(future, value)`,
        `stream.feed(items)`, or a role's own coroutine starter); dropped once the event loop closed
        (nobody is waiting any more)."""
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed
            pass

    def attach(self, stream: RequestStream) -> None:
        """Engine thread: route the engine's next outputs of `stream.request_id` to `stream`."""
        self.streams[stream.request_id] = stream

    # ----- engine thread: the loop -----
    def _run(self) -> None:
        try:
            lockstep = self.engine.lockstep
            if lockstep is not None:
                self._run_lockstep(lockstep)
            else:
                self._run_single()
        except BaseException as e:  # noqa: BLE001 - the thread must not die silently
            log.exception("engine loop crashed", instance=self.instance_id)
            self._end_reason = f"engine loop crashed: {type(e).__name__}: {e}"
        finally:
            self._fail_all(Unavailable("the worker is shutting down"))
            self._drain_after_stop()
            if self.ended is not None:
                self.post(settle, self.ended, self._end_reason)

    def _run_single(self) -> None:
        while self._drain(self._wait_s()):
            if self.role is not None:
                self.role.poll()
            if self.engine.has_unfinished:
                self._step()

    def _run_lockstep(self, lockstep: LockstepStepper) -> None:
        """DEP: one collective step per iteration until a rank stops (see the module docstring)."""
        idle_s, stopping = 0.0, False
        while True:
            if not stopping and not self._pause(idle_s):
                stopping = True
                lockstep.request_stop()
            try:
                outputs = self.engine.step()
            except RuntimeError as e:  # a rank died or a collective timed out: the group broke
                first_line = str(e).partition("\n")[0][:200]
                self._end_reason = f"the DEP group broke: {first_line}"
                log.error("DEP group broke", instance=self.instance_id, error=self._end_reason)
                log.debug("DEP group broke", instance=self.instance_id, exc_info=True)
                return
            self._deliver_outputs(outputs)
            record = lockstep.last
            if record is None:  # every lockstep step records itself
                raise RuntimeError("a lockstep step left no record")
            if record.stop:
                self._end_reason = (
                    "stopped" if stopping else "another rank of this DEP instance stopped"
                )
                return
            idle_s = (
                0.0
                if record.ran_forward
                else min(max(2 * idle_s, IDLE_SYNC_MIN_S), IDLE_SYNC_MAX_S)
            )

    def _pause(self, wait_s: float) -> bool:
        """DEP, between syncs: run commands and poll the role for up to `wait_s` (NIXL every
        `BUSY_WAIT_S` while the role is busy), less once this rank has work. False once asked to
        stop."""
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
            command = (
                self._commands.get(timeout=timeout) if timeout > 0 else self._commands.get_nowait()
            )
        except queue.Empty:
            return True
        while isinstance(command, _Command):  # anything else is _STOP
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
                result = command.fn(*command.args)
                if command.future is not None:
                    self.post(settle, command.future, result)
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            if command.future is None:
                log.exception("engine command failed", command=command.fn.__name__)
            else:
                self.post(settle, command.future, None, e)

    def _drain_after_stop(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Command) and command.future is not None:
                self.post(settle, command.future, None, Unavailable("the worker is shutting down"))

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
        now = time.monotonic()
        for output in outputs:
            taken = self.role is not None and self.role.take(output)
            self.metrics.observe_output(output, taken, now)
            if taken:
                continue
            stream = self.streams.get(output.request_id)
            if stream is not None:
                items.append((stream, output))
                if output.finish_reason is not None:
                    del self.streams[output.request_id]
        if items:
            self.post(feed, items)

    # ----- engine thread: commands -----
    def _generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, stream: RequestStream
    ) -> None:
        self.engine.add_request(prompt_ids, params, request_id)
        self.attach(stream)
        self.metrics.request_taken()
        self.metrics.prompt_submitted(request_id)

    def _abort(self, request_id: str) -> bool:
        found, busy = self.role.abort(request_id) if self.role is not None else (False, False)
        if busy:  # NIXL may still use the blocks: the role frees them when that is over
            return True
        found = self.engine.abort(request_id) or found
        self.metrics.forget(request_id)
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            self.post(feed, [(stream, stream.aborted_output())])
        return found

    def _status(self, check_integrity: bool) -> EngineStatus:
        error = ""
        if check_integrity:
            try:
                self.engine.check_integrity()
            except AssertionError as e:
                error = str(e) or "the KV pool's integrity check failed"
        core = self.engine.status()
        self.metrics.observe_spec_decode(core.spec_decode)
        kv = core.kv
        return EngineStatus(
            core.num_running,
            core.num_waiting,
            kv.num_used,
            kv.num_free + kv.num_cached,
            kv.num_blocks,
            self.metrics.snapshot(),
            check_integrity,
            error,
            *self.group_rank(),
            core.expert_weight_bytes,
            core.spec_decode,
        )

    def group_rank(self) -> tuple[int, int]:
        """(rank, ranks) in the DEP group now: an elastic group's change when it re-forms."""
        dep = getattr(self.engine, "dep", None)
        elastic = dep.elastic if dep is not None else None
        return (elastic.rank, elastic.size) if elastic is not None else (self.rank, self.dp_size)

    def _fail_all(self, error: BaseException) -> None:
        """End every request with `error`; blocks NIXL still reads or writes stay until the role
        frees them."""
        if self.streams:
            self.post(feed, [(stream, error) for stream in self.streams.values()])
        self.streams.clear()
        self.metrics.forget_all()
        busy = self.role.fail_all(error) if self.role is not None else set()
        for request_id in self.engine.request_ids():
            if request_id not in busy:
                self.engine.abort(request_id)
