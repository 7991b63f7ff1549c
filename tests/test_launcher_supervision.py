"""`pdmesh.supervisor.Supervisor`, the launcher's restart loop, over real processes (`sleep`) with
the time passed in: restart after the backoff with the same command, give up past the budget, keep
watching while a restart waits for SERVING, and stop from its own thread."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest

from pdmesh.supervisor import Supervisor
from pdmesh_service.supervision import RestartPolicy, RestartRecord

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


@dataclass
class ReadyWhenTold:
    """A probe that answers SERVING once the test says so."""

    ready: threading.Event = field(default_factory=threading.Event)
    closed: bool = False

    def poll(self) -> bool:
        return self.ready.is_set()

    def close(self) -> None:
        self.closed = True


@dataclass
class SleepUnit:
    """A service that is a `sleep` process; `spawns` counts its starts."""

    name: str
    probe_of: ReadyWhenTold = field(default_factory=ReadyWhenTold)
    process: subprocess.Popen | None = None
    spawns: int = 0

    def __post_init__(self) -> None:
        self.spawn()
        self.spawns = 0

    def current(self) -> subprocess.Popen | None:
        return self.process

    def spawn(self) -> None:
        self.process = subprocess.Popen(SLEEP)
        self.spawns += 1

    def probe(self) -> ReadyWhenTold:
        return self.probe_of

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def units():
    made: list[SleepUnit] = []
    yield made
    for unit in made:
        unit.stop()


def _supervisor(units: list[SleepUnit], policy: RestartPolicy, **kw) -> tuple[Supervisor, list]:
    lines: list[str] = []
    supervisor = Supervisor(units, policy, {}, progress=lines.append, **kw)  # type: ignore[arg-type]
    return supervisor, lines


def test_a_dead_process_is_restarted_after_the_backoff_and_recorded(units) -> None:
    units += [SleepUnit("decode-0"), SleepUnit("gateway-0")]
    decode, gateway = units
    written: list[dict[str, RestartRecord]] = []
    supervisor, lines = _supervisor(units, RestartPolicy(), record=written.append)
    first = decode.process.pid
    decode.kill()
    supervisor.tick(100.0)
    assert lines[-1] == "pdmesh up: decode-0 exited (code -9); restart 1 in 0.5 s"
    assert supervisor.restarts == {"decode-0": 1} and written[-1]["decode-0"].last_exit_code == -9
    supervisor.tick(100.4)
    assert decode.spawns == 0  # the backoff is not over
    supervisor.tick(100.5)
    assert decode.spawns == 1 and decode.process.pid != first
    supervisor.tick(100.6)
    assert "back" not in lines[-1]  # not SERVING yet
    decode.probe_of.ready.set()
    supervisor.tick(100.7)
    assert lines[-1] == "pdmesh up: decode-0 is back (SERVING, restart 1)"
    assert decode.probe_of.closed and gateway.spawns == 0
    # died again at once: twice the delay
    decode.kill()
    supervisor.tick(101.0)
    assert lines[-1].endswith("restart 2 in 1 s") and supervisor.restarts == {"decode-0": 2}


def test_past_the_budget_the_supervisor_gives_up(units) -> None:
    units += [SleepUnit("kvstore-0")]
    (kvstore,) = units
    supervisor, lines = _supervisor(units, RestartPolicy(max_restarts=2))
    now = 0.0
    for restart in (1, 2):
        kvstore.kill()
        supervisor.tick(now)
        supervisor.tick(now + 10)  # restarted
        assert kvstore.spawns == restart
        now += 20
    kvstore.kill()
    supervisor.tick(now)
    assert supervisor.gave_up == "kvstore-0" and supervisor.wait_gave_up(0) == "kvstore-0"
    assert "giving up" in lines[-1]
    supervisor.tick(now + 100)
    assert kvstore.spawns == 2  # nothing restarts once it gave up


def test_no_restarts_gives_up_on_the_first_death(units) -> None:
    units += [SleepUnit("eplb-0")]
    supervisor, _ = _supervisor(units, RestartPolicy(max_restarts=0))
    assert supervisor.wait_gave_up(0) is None
    units[0].kill()
    supervisor.tick(0.0)
    assert supervisor.wait_gave_up(0) == "eplb-0" and supervisor.restarts == {}


def test_other_deaths_are_seen_while_a_restart_waits_for_serving(units) -> None:
    units += [SleepUnit("decode-0"), SleepUnit("prefill-0")]
    decode, prefill = units
    supervisor, lines = _supervisor(units, RestartPolicy(), startup_timeout_s=30)
    decode.kill()
    supervisor.tick(0.0)
    supervisor.tick(1.0)  # decode restarted, never SERVING
    prefill.kill()
    supervisor.tick(2.0)
    assert lines[-1].startswith("pdmesh up: prefill-0 exited")
    supervisor.tick(3.0)
    assert prefill.spawns == 1
    prefill.probe_of.ready.set()
    supervisor.tick(3.5)
    assert lines[-1] == "pdmesh up: prefill-0 is back (SERVING, restart 1)"
    restarted = decode.process
    supervisor.tick(40.0)  # past the startup timeout: killed, then counted as a failed run
    assert restarted.wait(10) == -signal.SIGKILL
    supervisor.tick(40.5)
    assert lines[-1] == "pdmesh up: decode-0 exited (code -9); restart 2 in 1 s"


def test_records_that_fail_to_write_are_written_at_a_later_tick(units) -> None:
    units += [SleepUnit("gateway-0")]
    attempts: list[dict[str, RestartRecord]] = []

    def flaky(records: dict[str, RestartRecord]) -> None:
        attempts.append(records)
        if len(attempts) == 1:
            raise ConnectionError("redis is restarting")

    supervisor, _ = _supervisor(units, RestartPolicy(), record=flaky)
    units[0].kill()
    supervisor.tick(0.0)
    supervisor.tick(0.1)
    supervisor.tick(0.2)
    assert len(attempts) == 2 and attempts[1]["gateway-0"].restarts == 1


def test_the_thread_restarts_and_runs_the_shutdown_itself(units) -> None:
    units += [SleepUnit("decode-0")]
    (decode,) = units
    decode.probe_of.ready.set()
    supervisor, lines = _supervisor(units, RestartPolicy())
    supervisor.start()
    decode.kill()
    deadline = time.monotonic() + 30  # the thread ticks every 0.5 s; the first restart waits 0.5 s
    while not any("is back" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert decode.spawns == 1 and decode.process.poll() is None
    ran_in: list[str] = []
    supervisor.stop(lambda: ran_in.append(threading.current_thread().name))
    assert ran_in == ["pdmesh-supervisor"]


def test_engine_ranks_run_niced_and_the_control_plane_does_not(tmp_path) -> None:
    import functools
    import os
    from pathlib import Path

    from pdmesh.launcher import Mesh, MeshOptions, _child_setup, plan_mesh

    mesh = Mesh(MeshOptions(Path("m"), worker_nice=7, log_dir=tmp_path))
    nices = {s.role: mesh._nice(s) for s in plan_mesh(mesh.options)}
    assert nices == {"kvstore": 0, "eplb": 0, "prefill": 7, "decode": 7, "gateway": 0}
    base = os.nice(0)
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.nice(0))"],
        preexec_fn=functools.partial(_child_setup, 7),
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(child.stdout) == min(base + 7, 19)
    with pytest.raises(ValueError, match="--worker-nice"):
        MeshOptions(Path("m"), worker_nice=20)
