"""The rank's KV events → the kvstore's global prefix index.

Every `interval_s` the publisher drains the engine's prefix-cache changes (`KVCacheManager.
take_events`, as a command in the engine thread: the engine is never touched from here) and, when
there are any, or `keepalive_s` passed since the last send, sends them as the next numbered batch
(`KVStoreClient.publish_kv_events`, seq = the previous + 1). The first send, every send after the
kvstore answered resync (it restarted or missed a batch), after a failed send (kvstore down: logged
once, tried again next interval) and after the engine dropped a batch too large to keep is a
snapshot: every hash the pool holds, taken in the engine thread together with the drain, sent in
batches of at most `SNAPSHOT_CHUNK` hashes (the first marked snapshot, the rest as stored). The
keepalive (an empty batch) is what makes a restarted kvstore ask an idle rank for its snapshot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdmesh_service.errors import MeshError
from pdmesh_service.logging import get_logger

if TYPE_CHECKING:
    from pdmesh_engine.engine_core import EngineCore
    from pdmesh_service.worker.engine_loop import EngineLoop

log = get_logger(__name__)
PUBLISH_INTERVAL_S = 0.2
KEEPALIVE_S = 1.0
SNAPSHOT_CHUNK = 1 << 16  # hashes per message (16 bytes each: 1 MiB, under gRPC's 4 MiB default)


class KVEventSink(Protocol):
    """Where batches go (`KVStoreClient`)."""

    async def publish_kv_events(
        self,
        rank_id: str,
        seq: int,
        stored: Sequence[bytes],
        removed: Sequence[bytes] = (),
        snapshot: bool = False,
    ) -> bool: ...


@dataclass(frozen=True, slots=True)
class KVBatch:
    """What the engine thread hands over: the changes since the last drain, or (`is_snapshot`)
    every hash the pool holds, in `stored`."""

    stored: list[bytes]
    removed: list[bytes]
    is_snapshot: bool

    @property
    def is_empty(self) -> bool:
        return not self.stored and not self.removed and not self.is_snapshot


def drain_kv_events(engine: EngineCore, snapshot: bool) -> KVBatch:
    """Engine thread: the pending changes, or a snapshot when asked for or when the engine lost a
    batch (pending changes are dropped either way: the snapshot covers them)."""
    events = engine.kv.take_events()
    if snapshot or events.is_lost:
        return KVBatch(engine.kv.cached_hashes(), [], True)
    return KVBatch(events.stored, events.removed, False)


def messages(batch: KVBatch, seq: int) -> list[tuple[int, list[bytes], list[bytes], bool]]:
    """The (seq, stored, removed, snapshot) messages of a batch, numbered from `seq`: one for
    changes, a snapshot split into chunks of `SNAPSHOT_CHUNK` (the first replaces, the rest add)."""
    if not batch.is_snapshot:
        return [(seq, batch.stored, batch.removed, False)]
    chunks = [
        batch.stored[begin : begin + SNAPSHOT_CHUNK]
        for begin in range(0, max(len(batch.stored), 1), SNAPSHOT_CHUNK)
    ]
    return [(seq + i, chunk, [], i == 0) for i, chunk in enumerate(chunks)]


class KVEventPublisher:
    """Publishes one rank's KV events (see the module docstring); `run()` until cancelled."""

    def __init__(
        self,
        loop: EngineLoop,
        sink: KVEventSink,
        rank_id: str,
        interval_s: float = PUBLISH_INTERVAL_S,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        self.loop, self.sink, self.rank_id = loop, sink, rank_id
        self.interval_s, self.keepalive_s = interval_s, keepalive_s
        self.seq = 0  # last batch sent
        self.needs_snapshot = True
        self.is_failing = False
        self._last_sent = float("-inf")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.publish_once()

    async def publish_once(self) -> bool:
        """Drain and send (if there is anything, or the keepalive is due); whether it sent."""
        try:
            batch: KVBatch = await self.loop.submit(
                drain_kv_events, self.loop.engine, self.needs_snapshot
            )
        except MeshError:  # the engine loop ended (a DEP group broke): the worker is stopping
            return False
        if batch.is_empty and time.monotonic() - self._last_sent < self.keepalive_s:
            return False
        resync = False
        try:
            for seq, stored, removed, snapshot in messages(batch, self.seq + 1):
                self.seq = seq
                resync = await self.sink.publish_kv_events(
                    self.rank_id, seq, stored, removed, snapshot
                )
                if resync:
                    break
        except MeshError as e:
            if not self.is_failing:
                log.warning("publishing KV events failed; a snapshot follows", error=str(e))
            self.is_failing, self.needs_snapshot = True, True
            return False
        if self.is_failing:
            log.info("publishing KV events works again", rank=self.rank_id)
        self.is_failing, self.needs_snapshot = False, resync
        self._last_sent = time.monotonic()
        return True


def start_kv_event_publisher(
    loop: EngineLoop, sink: KVEventSink, rank_id: str
) -> asyncio.Future[None]:
    """Run a `KVEventPublisher` for the rank (cancel the returned task to stop it)."""
    return asyncio.ensure_future(KVEventPublisher(loop, sink, rank_id).run())
