"""A thin, synchronous NIXL (UCX) agent over one KV block pool: the prefill side pushes, the decode
side is told.

Chain: decode `KVTransferAgent(name, memory)` → `metadata()` published through the kvstore →
prefill `connect(name, metadata)` → `write_handoff(request_id, tables, name, decode groups, decode
tables, num_tokens)` = ONE NIXL WRITE (every group × pool × layer × coalesced run in one transfer
handle, notification = request id, with the digest of the bytes when asked: `digest`) → prefill
`poll`/`wait` → decode `arrivals()` returns the request id (and that digest) once every byte has
landed; `handoff_digest` is the receiver's digest of the same bytes in its blocks.

Contracts:
- the memory is the rank's KV groups (`layout.KVMemory`: V3 the pool `[L, N, B, D]` and, with
  speculative decoding, the proposer's pool on the same block ids; V4 its full and window pools),
  registered once; the tensors must outlive the agent, which never allocates KV memory. Every
  WRITE carries every group's regions (one transfer, one notification): peers must hold the same
  groups (`layout.check_groups`);
- one thread drives an agent (the worker's engine thread); a lock only guards against accidental
  sharing;
- a WRITE completes only while the receiving agent makes progress, so a receiving (decode) agent
  keeps NIXL's progress thread (`progress_thread=True`, the default: woken by UCX events, sleeping
  `progress_delay_us` between idle checks where nixl's own default spins at ~40% of a core per
  agent); a sending (prefill) agent is driven by its own `poll`/`wait` and is faster without one on
  few cores (`pdmesh bench kvxfer --sender-progress-thread` shows the difference);
- `write` raises ValueError for a bad plan and `TransferError` when NIXL refuses to start the
  transfer; a transfer that starts and then fails ends as FAILED from `poll`/`wait`;
- `write_handoff(corrupt_at=...)` is a test hook (`digest.corrupt_plan`): one byte of the WRITE is
  sent flipped from a scratch buffer the agent registers on first use; its own KV stays intact.

Transport (UCX picks it; `UCX_TLS` overrides): on one host block bytes go by `cma` (one kernel copy,
process_vm_writev), notifications and connection set-up by `tcp`. UCX's tcp transport listens on
every network device in `UCX_NET_DEVICES`, which UCX reads from the process environment when an
agent is built. This module never sets it: the service entry does, once at process start (`lo` when
the service binds loopback; compose and Kubernetes set e.g. `eth0` or an RDMA device as
configuration).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from nixl import _api as nixl_api

from pdmesh_engine.transfer.digest import (
    Notice,
    RegionReader,
    corrupt_plan,
    decode_notification,
    digest_regions,
    encode_notification,
)
from pdmesh_engine.transfer.layout import (
    KVGroup,
    KVMemory,
    PoolLayout,
    WritePlan,
    handoff_regions,
    plan_handoff,
    plan_write_pools,
)

State = Literal["PENDING", "DONE", "FAILED"]
_CONFIG_LOCK = threading.Lock()
_SCRATCH_BYTES = 4096  # corrupted bytes in flight at once (the fault hook), reused in turn


class TransferError(RuntimeError):
    """NIXL refused a transfer (unknown peer, unregistered memory, backend error)."""


@dataclass
class Transfer:
    """One WRITE in flight; `state` is final once DONE or FAILED (the NIXL handle is then
    released)."""

    request_id: str
    peer_name: str
    nbytes: int  # every pool's bytes
    num_regions: int  # descriptors per side (pools × layers × coalesced runs)
    started_s: float  # time.perf_counter() when posted
    handle: Any = field(default=None, repr=False)
    state: State = "PENDING"
    finished_s: float | None = None
    draft_nbytes: int = 0  # of nbytes, the proposer pool's (KV group `draft`)
    digest: int | None = None  # of the bytes sent, when asked (`digest.digest_regions`)
    corrupted_address: int | None = None  # the fault hook: the source byte sent flipped

    @property
    def target_nbytes(self) -> int:
        """Of nbytes, the target KV pool's."""
        return self.nbytes - self.draft_nbytes

    @property
    def seconds(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.started_s


def _new_nixl_agent(name: str, progress_thread: bool, progress_delay_us: int) -> Any:
    """`nixl_agent(name)` with the UCX backend and the progress thread's idle delay set.

    nixl's Python wrapper hard-codes `pthrDelay = 0` (a busy loop); the config class is swapped,
    only while the agent is built, for one that keeps our delay. If the bindings change shape, fall
    back.
    """
    config = nixl_api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    bindings = getattr(nixl_api, "nixlBind", None)
    base = getattr(bindings, "nixlAgentConfig", None)
    with _CONFIG_LOCK:
        if base is None or not progress_thread:
            return nixl_api.nixl_agent(name, config)

        class _DelayedConfig(base):  # type: ignore[misc, valid-type]
            def __setattr__(self, key: str, value: Any) -> None:
                super().__setattr__(key, progress_delay_us if key == "pthrDelay" else value)

        bindings.nixlAgentConfig = _DelayedConfig
        try:
            return nixl_api.nixl_agent(name, config)
        finally:
            bindings.nixlAgentConfig = base


class KVTransferAgent:
    """Owns one NIXL agent and the registration of a rank's KV groups."""

    def __init__(
        self,
        name: str,
        kv: torch.Tensor | Sequence[KVMemory],
        progress_thread: bool = True,
        progress_delay_us: int = 1000,
        draft_kv: torch.Tensor | None = None,
    ) -> None:
        """`kv`: the rank's KV groups, or one pool (group `kv`, with `draft_kv` as group `draft`
        on the same block ids)."""
        if not name:
            raise ValueError("agent name must not be empty")
        self.name = name
        if isinstance(kv, torch.Tensor):
            kv = [KVMemory("kv", (kv,))]
            if draft_kv is not None:
                kv.append(KVMemory("draft", (draft_kv,), table="kv"))
        self.memory = tuple(kv)
        self.groups: tuple[KVGroup, ...] = tuple(m.group() for m in self.memory)
        if len({g.pools[0].num_blocks for g in self.groups if g.name in ("kv", "draft")}) > 1:
            raise ValueError(
                "the proposer pool and the KV pool differ in blocks: both are addressed by the "
                "same block ids"
            )
        self._lock = threading.RLock()
        self._agent = _new_nixl_agent(name, progress_thread, progress_delay_us)
        self._registrations = [
            self._agent.register_memory(tensor) for m in self.memory for tensor in m.tensors
        ]
        self._peers: dict[str, bytes] = {}  # peer name -> metadata it was added with
        self._reader = RegionReader(t for m in self.memory for t in m.tensors)
        self._scratch: torch.Tensor | None = None  # the fault hook's flipped bytes
        self._num_scratch_used = 0
        self.bytes_sent = self.num_transfers = self.num_failures = 0
        self._closed = False

    @property
    def layout(self) -> PoolLayout:
        """The first pool of the first group (V3: the KV pool)."""
        return self.groups[0].pools[0]

    @property
    def draft_layout(self) -> PoolLayout | None:
        """The speculative proposer's pool (group `draft`), None without one."""
        return next((g.pools[0] for g in self.groups if g.name == "draft"), None)

    def metadata(self) -> bytes:
        """What peers pass to `connect` (publish it through the kvstore)."""
        return self._agent.get_agent_metadata()

    def connect(self, peer_name: str, metadata: bytes) -> None:
        """Make `peer_name` writable; a no-op when already connected with the same metadata.

        New metadata under a known name (the peer restarted) replaces the old connection. ValueError
        when the metadata names another agent; TransferError when NIXL cannot load it.
        """
        if peer_name == self.name:
            raise ValueError(f"agent {self.name!r} cannot connect to itself")
        with self._lock:
            known = self._peers.get(peer_name)
            if known == metadata:
                return
            if known is not None:
                self._agent.remove_remote_agent(peer_name)
                del self._peers[peer_name]
            try:
                added = self._agent.add_remote_agent(metadata)
            except Exception as e:  # noqa: BLE001 - nixl raises its own binding exceptions
                raise TransferError(f"cannot load the metadata of {peer_name!r}: {e}") from e
            added = added.decode() if isinstance(added, bytes) else added
            if added != peer_name:
                self._agent.remove_remote_agent(added)
                raise ValueError(f"metadata is agent {added!r}, not {peer_name!r}")
            self._peers[peer_name] = metadata

    def is_connected(self, peer_name: str) -> bool:
        return peer_name in self._peers

    def write(
        self,
        request_id: str,
        local_block_ids: Sequence[int],
        peer_name: str,
        peer_layout: PoolLayout,
        remote_block_ids: Sequence[int],
        peer_draft_layout: PoolLayout | None = None,
    ) -> Transfer:
        """Post ONE WRITE copying local block `local_block_ids[i]` to the peer's
        `remote_block_ids[i]`, all layers, of the KV pool and (with speculative decoding) of the
        proposer's pool into the peer's `peer_draft_layout`. ValueError when one side has a
        proposer pool and the other not.

        The peer is notified with `request_id` (utf-8) after the bytes land. Returns at once; see
        `poll`.
        """
        pools = [(self.layout, peer_layout)]
        if (self.draft_layout is None) != (peer_draft_layout is None):
            mine = "has a" if self.draft_layout is not None else "has no"
            theirs = "has one" if peer_draft_layout is not None else "has none"
            raise ValueError(
                f"agent {self.name!r} {mine} speculative proposer pool and {peer_name!r} {theirs}"
            )
        if self.draft_layout is not None and peer_draft_layout is not None:
            pools.append((self.draft_layout, peer_draft_layout))
        plan = plan_write_pools(pools, local_block_ids, remote_block_ids)
        return self._post(request_id, peer_name, peer_layout.memory_type, plan)

    def write_handoff(
        self,
        request_id: str,
        local_tables: dict[str, list[int]],
        peer_name: str,
        peer_groups: Sequence[KVGroup],
        remote_tables: dict[str, list[int]],
        num_tokens: int,
        digest: bool = False,
        corrupt_at: float | None = None,
    ) -> Transfer:
        """Post ONE WRITE of the KV of a request's first `num_tokens` tokens: per KV group, the
        blocks `layout.plan_handoff` names, from this rank's tables of the request (by group) to
        the peer's. ValueError when the groups differ or a table is short; see `write`.

        `digest`: the notification carries the digest of the bytes sent (computed here, before the
        WRITE is posted). `corrupt_at` (fault hook, a fraction of the WRITE's bytes): that byte
        lands flipped."""
        plan = plan_handoff(self.groups, local_tables, peer_groups, remote_tables, num_tokens)
        value = digest_regions(self._reader, plan.local) if digest else None
        corrupted = None
        if corrupt_at is not None:
            plan, corrupted = self._corrupted(plan, corrupt_at)
        transfer = self._post(
            request_id,
            peer_name,
            peer_groups[0].pools[0].memory_type,
            plan,
            encode_notification(request_id, value),
        )
        transfer.digest, transfer.corrupted_address = value, corrupted
        return transfer

    def handoff_digest(self, tables: dict[str, list[int]], num_tokens: int) -> int:
        """The digest of a hand-off of `num_tokens` tokens as it lies in this rank's blocks
        (`tables`: by KV group): equal to the sender's when every byte arrived intact."""
        return digest_regions(self._reader, handoff_regions(self.groups, tables, num_tokens))

    def _corrupted(self, plan: WritePlan, corrupt_at: float) -> tuple[WritePlan, int]:
        """The plan with one byte sent flipped from a scratch buffer (`digest.corrupt_plan`)."""
        if self._scratch is None:
            device = self.memory[0].tensors[0].device
            self._scratch = torch.zeros(_SCRATCH_BYTES, dtype=torch.uint8, device=device)
            self._registrations.append(self._agent.register_memory(self._scratch))
        slot = self._num_scratch_used % _SCRATCH_BYTES
        self._num_scratch_used += 1
        position = min(int(corrupt_at * plan.nbytes), plan.nbytes - 1)
        local, remote, source = corrupt_plan(
            plan.local, plan.remote, position, self._scratch.data_ptr() + slot
        )
        self._scratch[slot] = self._reader.view(source, 1)[0] ^ 0xFF
        if self._scratch.device.type == "cuda":  # the WRITE reads it outside torch's streams
            torch.cuda.synchronize(self._scratch.device)
        return replace(plan, local=local, remote=remote), source

    def _post(
        self,
        request_id: str,
        peer_name: str,
        peer_memory: str,
        plan: WritePlan,
        notification: bytes | None = None,
    ) -> Transfer:
        with self._lock:
            if peer_name not in self._peers:
                raise ValueError(f"not connected to agent {peer_name!r}")
            try:
                local = self._agent.get_xfer_descs(plan.local, self.layout.memory_type)
                remote = self._agent.get_xfer_descs(plan.remote, peer_memory)
                handle = self._agent.initialize_xfer(
                    "WRITE", local, remote, peer_name, notification or request_id.encode()
                )
            except Exception as e:  # noqa: BLE001 - nixl raises its own binding exceptions
                self.num_failures += 1
                raise TransferError(
                    f"cannot start transfer of {request_id!r} to {peer_name!r}: {e}"
                ) from e
            draft = plan.group_nbytes.get("draft", 0) if plan.group_nbytes else None
            transfer = Transfer(
                request_id,
                peer_name,
                plan.nbytes,
                len(plan.local),
                time.perf_counter(),
                handle,
                draft_nbytes=sum(plan.pool_nbytes[1:]) if draft is None else draft,
            )
            self.num_transfers += 1
            if self._agent.transfer(handle) == "ERR":
                self._finish(transfer, "FAILED")
            return transfer

    def poll(self, transfer: Transfer) -> State:
        """Where the transfer stands; DONE and FAILED are final (the NIXL handle is released
        then)."""
        with self._lock:
            if transfer.state != "PENDING":
                return transfer.state
            status = self._agent.check_xfer_state(transfer.handle)
            if status == "DONE":
                self._finish(transfer, "DONE")
            elif status == "ERR":
                self._finish(transfer, "FAILED")
            return transfer.state

    def wait(self, transfer: Transfer, timeout_s: float = 10.0) -> State:
        """Poll until final or `timeout_s` passes; PENDING means it timed out (poll again, or
        `abort`)."""
        deadline = time.perf_counter() + timeout_s
        spins = 0
        while (state := self.poll(transfer)) == "PENDING" and time.perf_counter() < deadline:
            spins += 1
            if spins > 100:  # past the first ~100 polls, stop hogging the core
                time.sleep(50e-6)
        return state

    def abort(self, transfer: Transfer) -> None:
        """Give up on a pending transfer (NIXL cancels it if it can); it ends FAILED."""
        with self._lock:
            if transfer.state == "PENDING":
                self._finish(transfer, "FAILED")

    def arrivals(self) -> list[Notice]:
        """The WRITEs that have fully landed in this agent's pool since the last call, from any
        peer: each one's request id and the sender's digest (None: sent without one)."""
        with self._lock:
            found = self._agent.get_new_notifs()
        return [decode_notification(message) for messages in found.values() for message in messages]

    def notifications(self) -> list[str]:
        """The request ids of `arrivals()` (consumes the same notifications)."""
        return [notice.request_id for notice in self.arrivals()]

    def close(self) -> None:
        """Forget peers and deregister the memory; the agent is unusable afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for peer in list(self._peers):
                self._agent.remove_remote_agent(peer)
            self._peers.clear()
            for registration in self._registrations:
                self._agent.deregister_memory(registration)

    def _finish(self, transfer: Transfer, state: State) -> None:
        transfer.state, transfer.finished_s = state, time.perf_counter()
        if state == "DONE":
            self.bytes_sent += transfer.nbytes
        else:
            self.num_failures += 1
        handle, transfer.handle = transfer.handle, None
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - a handle NIXL cannot cancel is reclaimed when the agent goes
            pass
