"""The kvstore's Redis adapter: NIXL agent metadata and one hand-off hash per request.

Keys (prefix `pdmesh:{deployment}`):
    agent:{name}          hash {metadata (bytes), instance_id, updated_ms}; kept until re-registered
    handoff:{request_id}  hash of `core.Handoff.to_fields()`; TTL = the lease plus `grace_ms`
                          (renewed on every change) while RESERVED/TRANSFERRING/READY, then
                          `retention_ms`
                          once final. Decode ends a reservation by moving it to EXPIRED/CANCELLED;
                          the TTL only sweeps records whose owner vanished. A finished one can still
                          be read for a while, and `open_handoff` replaces it (a retry under the
                          same request id)

Changes are compare-and-set: read, `core.check_expected` and `core.advance` (the legality checks),
then a Lua script writes only if the state is still the one read and the record is still the same
incarnation (a hidden `epoch` field, new at every open: a record replaced by a retry could be in the
same state again). That is sound because the state graph has no cycle. A lost race re-reads (and
then fails the caller's `expected` state, if it gave one).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import redis.asyncio as aioredis

from pdmesh_kvstore import core
from pdmesh_kvstore.core import Handoff, HandoffState
from pdmesh_service.errors import FailedPrecondition, InvalidArgument, NotFound
from pdmesh_service.registry import namespace

# KEYS[1] hand-off; ARGV[1] ttl ms; ARGV[2..] field, value, ... → 1 created, 0 a live record exists.
_OPEN = """
local final = FINAL
local state = redis.call('HGET', KEYS[1], 'state')
if state and not final[state] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
""".replace("FINAL", "{" + ", ".join(f"{s.name} = true" for s in sorted(core.TERMINAL)) + "}")
# KEYS[1] hand-off; ARGV[1] state read; ARGV[2] epoch read; ARGV[3] ttl ms; ARGV[4..] field, value,
# ... → 1 set, 0 raced, -1 gone.
_CAS = """
local current = redis.call('HMGET', KEYS[1], 'state', 'epoch')
if not current[1] then return -1 end
if current[1] ~= ARGV[1] or (current[2] or '') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
_CAS_ATTEMPTS = 4  # > the longest path in the state graph


def _flat(fields: dict[str, str]) -> list[str]:
    return [item for pair in fields.items() for item in pair]


class KVStore:
    """Async store over one Redis client (the caller owns and closes it)."""

    def __init__(
        self,
        client: aioredis.Redis,
        deployment: str = "default",
        retention_ms: int = 60_000,
        clock: Callable[[], float] = time.time,
        grace_ms: int = core.DEFAULT_GRACE_MS,
    ) -> None:
        if retention_ms < 1 or grace_ms < 0:
            raise ValueError(
                f"need retention_ms >= 1 and grace_ms >= 0, got {retention_ms} and {grace_ms}"
            )
        self.client, self.prefix = client, namespace(deployment)
        self.retention_ms, self.grace_ms, self.clock = retention_ms, grace_ms, clock
        self._open = client.register_script(_OPEN)
        self._cas = client.register_script(_CAS)

    def agent_key(self, name: str) -> str:
        return f"{self.prefix}:agent:{name}"

    def handoff_key(self, request_id: str) -> str:
        return f"{self.prefix}:handoff:{request_id}"

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    # ----- agents -----
    async def put_agent(self, name: str, metadata: bytes, instance_id: str) -> None:
        if not name or not metadata:
            raise InvalidArgument("an agent needs a name and metadata")
        await self.client.hset(
            self.agent_key(name),
            mapping={
                "metadata": metadata,
                "instance_id": instance_id,
                "updated_ms": str(self._now_ms()),
            },
        )

    async def get_agent(self, name: str) -> tuple[bytes, str]:
        """(metadata, instance_id); NotFound if never registered."""
        fields = await self.client.hgetall(self.agent_key(name))
        if not fields:
            raise NotFound(f"no NIXL agent named {name!r}")
        return fields[b"metadata"], fields.get(b"instance_id", b"").decode()

    # ----- hand-offs -----
    async def open_handoff(
        self, request_id: str, decode_instance: str, num_blocks: int, lease_ms: int
    ) -> Handoff:
        """A new RESERVED record, replacing a terminal one; FailedPrecondition if a live one
        exists."""
        handoff = core.open_handoff(
            request_id, decode_instance, num_blocks, lease_ms, self._now_ms()
        )
        fields = {**handoff.to_fields(), "epoch": uuid.uuid4().hex}
        created = await self._open(
            keys=[self.handoff_key(request_id)], args=[self._ttl_ms(handoff), *_flat(fields)]
        )
        if not created:
            raise FailedPrecondition(f"a live hand-off for request {request_id!r} already exists")
        return handoff

    async def get_handoff(self, request_id: str) -> Handoff:
        return (await self._read(request_id))[0]

    async def _read(self, request_id: str) -> tuple[Handoff, str]:
        """(the record, its epoch); NotFound if there is none."""
        fields = await self.client.hgetall(self.handoff_key(request_id))
        if not fields:
            raise NotFound(
                f"no hand-off for request {request_id!r} (never opened, or its record lapsed)"
            )
        return Handoff.from_fields(fields), fields.get(b"epoch", b"").decode()

    async def update_handoff(
        self,
        request_id: str,
        state: HandoffState,
        prefill_instance: str = "",
        expected: HandoffState | None = None,
    ) -> Handoff:
        """See `transition`; the record after it."""
        return (await self.transition(request_id, state, prefill_instance, expected))[0]

    async def transition(
        self,
        request_id: str,
        state: HandoffState,
        prefill_instance: str = "",
        expected: HandoffState | None = None,
    ) -> tuple[Handoff, bool]:
        """Move to `state` atomically, only from `expected` if given: (the record, whether it
        changed). FailedPrecondition if illegal or not in `expected`, NotFound if gone; a move to
        the state the record is in already changes nothing (unless `expected` says otherwise)."""
        key = self.handoff_key(request_id)
        for _ in range(_CAS_ATTEMPTS):
            current, epoch = await self._read(request_id)
            core.check_expected(current, expected)
            updated = core.advance(current, state, prefill_instance, self._now_ms())
            if updated is current:
                return current, False
            result = await self._cas(
                keys=[key],
                args=[
                    current.state.name,
                    epoch,
                    self._ttl_ms(updated),
                    *_flat(updated.to_fields()),
                ],
            )
            if result == 1:
                return updated, True
            if result == -1:
                raise NotFound(
                    f"the hand-off of request {request_id!r} is gone (its record lapsed)"
                )
        raise FailedPrecondition(f"the hand-off of request {request_id!r} kept changing; retry")

    def _ttl_ms(self, handoff: Handoff) -> int:
        return core.ttl_ms(handoff, self.retention_ms, self.grace_ms)
