"""A virtual clock for asyncio: the simulator's coroutines run on an event loop whose time jumps to
the next timer instead of sleeping, so `await asyncio.sleep(step_s)` costs no wall time and the
gateway's own asyncio cores (`PrefillAdmission`) run unchanged.

The loop's selector never blocks: when nothing is ready it advances the clock by the timeout the
loop asked to wait (the delay to its earliest timer). A wait with no timer and nothing ready can
never end: it raises `Deadlock` instead of hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class Deadlock(RuntimeError):
    """Every coroutine waits and no timer is set."""


class _NoWaitSelector(selectors.BaseSelector):
    """A real selector (for the loop's self-pipe) whose `select` advances `now` instead of
    waiting."""

    def __init__(self) -> None:
        self._real = selectors.DefaultSelector()
        self.now = 0.0

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if ready:
            return ready
        if timeout is None:
            raise Deadlock("the simulation waits on nothing: no timer is set and nothing is ready")
        self.now += max(timeout, 0.0)
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time (seconds from 0)."""

    def __init__(self) -> None:
        self._virtual = _NoWaitSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to completion on a fresh `VirtualLoop`."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()
