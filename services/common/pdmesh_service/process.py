"""Child processes that must not outlive their parent (the launcher's services, a DEP supervisor's
ranks)."""

from __future__ import annotations

import ctypes
import functools
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _set_parent_death_signal(sig: signal.Signals) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
    except OSError:
        pass  # not Linux (no libc.so.6): the child may outlive its parent


def die_with_parent(sig: signal.Signals) -> Callable[[], None]:
    """A `preexec_fn` for `subprocess.Popen`: the child gets `sig` when its parent exits, even by
    SIGKILL (Linux's PR_SET_PDEATHSIG; a no-op elsewhere). SIGTERM lets it stop cleanly, SIGKILL
    stops it at once. "Parent" is the *thread* that spawned the child: a child spawned from a
    thread that ends gets `sig` then, so spawn from a thread that lives as long as the child
    should (the main thread, or a supervisor thread that also stops its children)."""
    return functools.partial(_set_parent_death_signal, sig)
