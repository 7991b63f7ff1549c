"""Background tasks that nobody awaits but that must not be garbage-collected or lost at
shutdown, and loops that stop when cancelled."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any


class Background:
    """Holds fire-and-forget tasks until they finish; `close()` cancels and awaits what is left."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def stop_with(
    stack: contextlib.AsyncExitStack, work: Coroutine[Any, Any, Any] | asyncio.Future[Any]
) -> None:
    """Run `work` as a task until `stack` closes, then cancel it and wait for its end (a loop in
    it pauses by `pause`)."""
    task = asyncio.ensure_future(work)

    async def stop() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    stack.push_async_callback(stop)


async def pause(delay_s: float) -> None:
    """Sleep before a loop's next turn; CancelledError first when the task was cancelled meanwhile.
    redis-py can swallow a cancellation that lands while it drops a connection (the command then
    fails, or even returns), so a loop that outlives Redis errors would run on after its cancel and
    whoever awaits its end would wait forever; `task.cancelling()` still tells."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
    await asyncio.sleep(delay_s)
