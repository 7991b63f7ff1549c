"""`pdmesh_service.process.die_with_parent`: the launcher's services and a DEP supervisor's ranks
end with it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

PARENT = """
import signal, subprocess, sys
from pdmesh_service.process import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         preexec_fn=die_with_parent(signal.SIGTERM))
print(child.pid, flush=True)
sys.exit(0)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_the_child_gets_the_signal_when_its_parent_exits() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PARENT], capture_output=True, text=True, check=True, timeout=60
    )
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(pid)
    if alive:
        os.kill(pid, 9)
    assert not alive, "the child outlived its parent"
