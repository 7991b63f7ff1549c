"""The DEP instance supervisor's watch and stop (`dep_instance._watch`, `_stop`) over real
processes: a rank that dies is reported, the ranks that notice it leave by themselves, the rest get
SIGTERM, and whatever ignores it SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

from pdmesh_service.worker.dep_instance import _stop, _watch


def _rank(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import signal, sys, time\n{code}"])


def test_a_dead_rank_stops_the_others_first_on_their_own_then_by_signal() -> None:
    ranks = [
        _rank("sys.exit(3)"),  # dies
        _rank("time.sleep(1.0); sys.exit(1)"),  # sees the group break, leaves by itself
        _rank("time.sleep(60)"),  # stuck: SIGTERM
        _rank("signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"),  # SIGKILL
    ]
    try:
        assert _watch(ranks, threading.Event()) == [0]
        _stop(ranks, grace_s=1.0, settle_s=2.0)
        assert [p.returncode for p in ranks] == [3, 1, -signal.SIGTERM, -signal.SIGKILL]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()


def test_a_stop_request_ends_the_watch_with_no_failed_rank() -> None:
    ranks = [_rank("time.sleep(60)")]
    stopping = threading.Event()
    stopping.set()
    try:
        assert _watch(ranks, stopping) == []
    finally:
        _stop(ranks, grace_s=5.0)
    assert ranks[0].returncode == -signal.SIGTERM
