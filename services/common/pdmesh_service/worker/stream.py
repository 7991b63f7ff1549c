"""`RequestStream`: one request's step outputs, fed from the engine thread, read on the event loop.

The engine thread never touches asyncio objects itself: it posts `feed(items)` or `settle(future,
...)` to the event loop (`EngineLoop.post`), where they run.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pdmesh_engine.scheduler import StepOutput


class RequestStream:
    """One request's step outputs, in order; ends after the output with a finish reason.

    Iterating yields lists of the outputs available at once. An engine failure ends the stream
    with the error raised from the iteration.
    """

    def __init__(self, request_id: str, num_prompt_tokens: int = 0) -> None:
        self.request_id, self.num_prompt_tokens = request_id, num_prompt_tokens
        self.queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def aborted_output(self) -> StepOutput:
        return StepOutput(self.request_id, [], [], [], "abort", None, self.num_prompt_tokens, 0)

    async def __aiter__(self) -> AsyncIterator[list[StepOutput]]:
        while not self.finished:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            steps: list[StepOutput] = []
            for item in items:
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                steps.append(item)
                if item.finish_reason is not None:
                    self.finished = True
                    break
            yield steps


StreamItem = tuple[RequestStream, StepOutput | BaseException]


def feed(items: Sequence[StreamItem]) -> None:
    """Event loop side: append each output (or the error that ends it) to its stream, in order."""
    for stream, item in items:
        stream.queue.put_nowait(item)


def settle(
    future: asyncio.Future[Any], value: Any = None, error: BaseException | None = None
) -> None:
    """Event loop side: resolve `future` with `value`, or fail it with `error`; a no-op once its
    caller gave up (cancelled) or it was resolved already."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
