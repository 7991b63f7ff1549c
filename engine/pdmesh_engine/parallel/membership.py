"""Who is in an elastic DEP group, agreed without any one rank: epochs recorded in a shared store.

A rank has a stable `member` id (its rank when the instance started, the `-r<id>` of its
endpoint); its rank in the group is its index in the epoch's `members`. Epoch 0 is the group the
instance started with (every member, met at the instance's own rendezvous). The records live in a
`CoordStore` that no rank hosts (the deployment's Redis for a service; a directory for tests and
one-host runs), so losing any rank, the first included, loses no record:

    failure at epoch e (every survivor, after aborting its groups):
      put  e+1/alive/<member>
      gather: until e+1/members exists, or every member of e but at most one is alive, or
              `settle_s` passed since this rank arrived; then the lowest alive member writes
              e+1/members (first write wins)
              = Membership(e+1, alive + joiners, the address of a TCPStore it serves, plan)
    growth at epoch e (every member, at the same step boundary: the DP sync said a join waits):
      the same gather, closed once every member of e arrived, joiners added
    join (a restarted rank): put join/<member>, then wait for a `current` record naming it

`current` always holds the newest record. A survivor that arrives after the record was written
without it is not a member (`NotAMember`): it leaves, and comes back by joining. The record's
`plan` is opaque here (the engine's expert placement per model, `pdmesh_engine.parallel.elastic`).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

Plan = dict[str, Any]  # JSON-able: what every member adopts with the record
POLL_S = 0.01


class CoordStore(Protocol):
    """A small key/value store every rank reaches and none hosts (strings, no expiry needed)."""

    def put(self, key: str, value: str, exclusive: bool = False) -> bool:
        """Write `key`; with `exclusive`, only if it does not exist. True if written."""
        ...

    def get(self, key: str) -> str | None: ...

    def keys(self, prefix: str) -> list[str]:
        """The keys that start with `prefix`."""
        ...


class FileCoordStore:
    """A `CoordStore` in a directory (ranks on one host, tests): one file per key, atomic writes
    (rename; `os.link` for an exclusive one)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / key.replace("/", "~")

    def put(self, key: str, value: str, exclusive: bool = False) -> bool:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(value)
        try:
            if not exclusive:
                os.replace(tmp, self._path(key))
                return True
            try:
                os.link(tmp, self._path(key))
            except FileExistsError:
                return False
            return True
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def get(self, key: str) -> str | None:
        try:
            return self._path(key).read_text()
        except FileNotFoundError:
            return None

    def keys(self, prefix: str) -> list[str]:
        mangled = prefix.replace("/", "~")
        return [p.name.replace("~", "/") for p in self.root.iterdir() if p.name.startswith(mangled)]


class NotAMember(RuntimeError):
    """The group re-formed without this rank (it arrived after the record was written)."""


@dataclass(frozen=True)
class Membership:
    """One epoch of the group: `members` by group rank, where its rendezvous store listens, and
    the plan every member adopts."""

    epoch: int
    members: tuple[int, ...]
    addr: str
    port: int
    plan: Plan = field(default_factory=dict)

    def rank_of(self, member: int) -> int:
        if member not in self.members:
            raise NotAMember(f"member {member} is not in epoch {self.epoch}: {self.members}")
        return self.members.index(member)

    def to_json(self) -> str:
        return json.dumps(
            dict(
                epoch=self.epoch,
                members=list(self.members),
                addr=self.addr,
                port=self.port,
                plan=self.plan,
            )
        )

    @classmethod
    def from_json(cls, text: str) -> Membership:
        d = json.loads(text)
        return cls(
            int(d["epoch"]), tuple(int(m) for m in d["members"]), d["addr"], d["port"], d["plan"]
        )


@dataclass(frozen=True)
class Gather:
    """How this rank takes part in forming epoch `epoch` (after `previous`)."""

    epoch: int
    member: int
    previous: tuple[int, ...]  # the members of epoch - 1 (all of them may be alive)
    settle_s: float  # how long survivors gather when more than `num_lost` members are missing
    wait_s: float  # how long to wait for the record at all
    num_lost: int = 1  # members of `previous` that may be missing for an early close (0: growth)


class MembershipStore:
    """The membership protocol (module docstring) over a `CoordStore`, under one key `prefix` per
    instance run."""

    def __init__(self, store: CoordStore, prefix: str) -> None:
        self.store, self.prefix = store, prefix.rstrip("/") + "/"

    def _key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def current(self) -> Membership | None:
        text = self.store.get(self._key("current"))
        return Membership.from_json(text) if text else None

    def publish(self, record: Membership) -> bool:
        """Write epoch `record.epoch` (first write wins) and make it `current`; True if ours."""
        if not self.store.put(self._key(record.epoch, "members"), record.to_json(), exclusive=True):
            return False
        self.store.put(self._key("current"), record.to_json())
        for member in record.members:  # a joiner is in: its request is done
            self.store.put(self._key("join", member), "", exclusive=False)
        return True

    def pending_joins(self, members: tuple[int, ...] = ()) -> list[int]:
        """Members asking to join (a non-empty join/<member>) that are not in `members`."""
        out = []
        for key in self.store.keys(self._key("join", "")):
            member = int(key.rsplit("/", 1)[1])
            if self.store.get(key) and member not in members:
                out.append(member)
        return sorted(out)

    def ask_to_join(self, member: int) -> None:
        self.store.put(self._key("join", member), str(time.time()))

    def gather(
        self, how: Gather, serve: Callable[[list[int]], tuple[str, int, Plan]]
    ) -> Membership:
        """Agree on epoch `how.epoch` (module docstring). `serve(members)`, called on the rank
        that closes the gathering only: the address and port of the TCPStore it now serves for the
        epoch, and the plan. Raises NotAMember, or TimeoutError after `wait_s`."""
        self.store.put(self._key(how.epoch, "alive", how.member), "1")
        start = time.monotonic()
        members_key = self._key(how.epoch, "members")
        while True:
            text = self.store.get(members_key)
            if text:
                record = Membership.from_json(text)
                record.rank_of(how.member)  # NotAMember
                return record
            elapsed = time.monotonic() - start
            if elapsed > how.wait_s:
                raise TimeoutError(f"no record of epoch {how.epoch} after {how.wait_s:g}s")
            alive = sorted(
                int(k.rsplit("/", 1)[1]) for k in self.store.keys(self._key(how.epoch, "alive", ""))
            )
            # every member of the last epoch, or all but one (one rank lost: the common case,
            # closed at once; a slow survivor left out joins again)
            complete = len(set(how.previous) - set(alive)) <= how.num_lost
            if (complete or elapsed >= how.settle_s) and alive and alive[0] == how.member:
                members = sorted(set(alive) | set(self.pending_joins(tuple(alive))))
                addr, port, plan = serve(members)
                self.publish(Membership(how.epoch, tuple(members), addr, port, plan))
                continue
            time.sleep(POLL_S)

    def wait_admitted(self, member: int, after_epoch: int, wait_s: float) -> Membership:
        """A joiner: the first `current` record after `after_epoch` that names `member`."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            record = self.current()
            if record is not None and record.epoch > after_epoch and member in record.members:
                return record
            time.sleep(POLL_S * 5)
        raise TimeoutError(f"member {member} was not admitted within {wait_s:g}s")
