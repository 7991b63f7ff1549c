"""Which worker rank gets a request (pure policy), and the loop that keeps the view fresh.

Policy: only `ready` instances that are not `draining` are routable (a draining rank finishes
what it holds: calls open to it stay open, it stays `is_live`).
- decode: fewest requests, counted as the rank's last heartbeat (`Load.num_running + num_waiting`)
  plus the requests this gateway sent it since that heartbeat (heartbeats lag; without this, a burst
  would all go to the same idle rank). With `DecodeBalance.KV_TOKENS`: fewest KV tokens (the
  heartbeat's blocks in use plus the prompts sent since), then fewest requests.
- prefill: fewest requests this gateway has in flight on it. (The orchestrator admits requests to
  prefill ranks through `admission.PrefillAdmission`, the same policy with a per-rank cap and a
  queue.)
Ties are broken in turn: the first tied instance (by id) after the one picked last time for that
role, so equal ranks take requests round robin. No candidate → `NoInstance` (503).

Revisions (`pdmesh_service.revision`; a rolling update runs two side by side until the old one
drains): a KV hand-off pairs a prefill and a decode rank of one revision only. A disaggregated
request's revision is `decode_revision`'s (`routing.choose_revision`: the least loaded decode
rank's, so the decode policy holds across revisions); its prefill candidates are
`ready(PREFILL, revision)` and its decode rank `pick_decode(exclude, revision)`. A revision with no
prefill rank up serves its requests on the decode rank alone (the agg path: no hand-off), never
across revisions. Both revisions take requests while both are up, by load alone (no preference
for the newer one: the registry does not say which is newer).

Events instead of polling: `on_membership` callbacks run when the set of ready ranks changes,
`departure(id)` is a future resolved once that rank is gone (`is_live` turned false), and
`next_view()` one resolved at the next view; so nothing waiting on the mesh wakes per waiter.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from contextlib import suppress

from pdmesh_gateway.routing import DecodeBalance, choose_revision
from pdmesh_service.errors import Unavailable
from pdmesh_service.instance import InstanceInfo, Role
from pdmesh_service.logging import get_logger
from pdmesh_service.tasks import pause

log = get_logger(__name__)


class NoInstance(Unavailable):
    """No ready instance of the needed role (not worth retrying at once)."""


def _now_ms() -> int:
    return int(time.time() * 1000)


DEFAULT_GONE_AFTER_S = 2.0


class Router:
    """`gone_after_s`: how long a rank may be missing from the registry view before calls open to
    it are abandoned (`is_live`); a short gap (Redis restarted, a late heartbeat) is not a death."""

    def __init__(
        self,
        gone_after_s: float = DEFAULT_GONE_AFTER_S,
        decode_balance: DecodeBalance = DecodeBalance.REQUESTS,
    ) -> None:
        self.gone_after_s, self.decode_balance = gone_after_s, DecodeBalance(decode_balance)
        self._instances: list[InstanceInfo] = []
        self._seen: dict[str, float] = {}  # instance id -> when last seen ready (time.monotonic)
        self._updated = 0.0  # when the view was last replaced
        self.refresh_error: str | None = None  # why the last registry read failed (None: it worked)
        # decode id -> (send time ms, prompt tokens) of the requests sent since its heartbeat
        self._sent: dict[str, list[tuple[int, int]]] = {}
        self._prefill_in_flight: dict[str, int] = {}
        self._last: dict[Role, str] = {}  # role -> id picked last
        self._membership: frozenset[tuple[str, Role]] = frozenset()  # the ready ranks
        self._on_membership: list[Callable[[], None]] = []
        self._departures: dict[str, asyncio.Future[None]] = {}
        self._next_view: asyncio.Future[None] | None = None

    def update(self, instances: Iterable[InstanceInfo]) -> None:
        """Replace the view with the registry's; forget sends that the new heartbeats include;
        then tell whoever waits on the mesh what changed."""
        self._instances = sorted(instances, key=lambda i: i.instance_id)
        now = self._updated = time.monotonic()
        self._seen.update((i.instance_id, now) for i in self._instances if i.ready)
        stamps = {i.instance_id: i.updated_ms for i in self._instances}
        self._sent = {
            k: [(t, n) for t, n in v if t > stamps[k]] for k, v in self._sent.items() if k in stamps
        }
        self._notify()

    def _notify(self) -> None:
        membership = frozenset((i.instance_id, i.role) for i in self._instances if _routable(i))
        if membership != self._membership:
            self._membership = membership
            for callback in list(self._on_membership):
                callback()
        for instance_id in [i for i in self._departures if not self.is_live(i)]:
            _resolve(self._departures.pop(instance_id))
        if self._next_view is not None:
            _resolve(self._next_view)
            self._next_view = None

    def on_membership(self, callback: Callable[[], None]) -> None:
        """Call `callback()` whenever a rank becomes ready or stops being ready (or registered)."""
        self._on_membership.append(callback)

    def departure(self, instance_id: str) -> asyncio.Future[None]:
        """A future resolved once the rank is gone (`is_live` false at a view); done already if it
        is gone now. Shared by every caller: await it through `asyncio.wait`, never cancel it."""
        future = self._departures.get(instance_id)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            if self.is_live(instance_id):
                self._departures[instance_id] = future
            else:
                future.set_result(None)
        return future

    def next_view(self) -> asyncio.Future[None]:
        """A future resolved when the next view arrives (shared, as `departure`'s)."""
        if self._next_view is None:
            self._next_view = asyncio.get_running_loop().create_future()
        return self._next_view

    def snapshot(self) -> list[InstanceInfo]:
        return list(self._instances)

    def ready(self, role: Role, revision: str | None = None) -> list[InstanceInfo]:
        """The routable ranks of `role` (ready, not draining); of `revision` only when given."""
        return [
            i
            for i in self._instances
            if i.role == role and _routable(i) and (revision is None or i.revision == revision)
        ]

    def has_ready(self, role: Role) -> bool:
        return any(i.role == role and _routable(i) for i in self._instances)

    def revisions(self, role: Role) -> dict[str, int]:
        """Revision → routable ranks of `role` running it (a rolling update shows two)."""
        counts: dict[str, int] = {}
        for i in self.ready(role):
            counts[i.revision] = counts.get(i.revision, 0) + 1
        return counts

    def is_live(self, instance_id: str) -> bool:
        """Whether the rank was ready in the views of the last `gone_after_s` before the latest
        one (while the registry cannot be read, the last view stands and nobody is gone)."""
        seen = self._seen.get(instance_id)
        return seen is not None and self._updated - seen <= self.gone_after_s

    def decode_load(self, info: InstanceInfo) -> tuple[int, ...]:
        load, sent = info.stats, self._sent.get(info.instance_id, ())
        requests = load.num_running + load.num_waiting + len(sent)
        if self.decode_balance is DecodeBalance.KV_TOKENS:
            held = load.num_kv_blocks_used * max(info.block_size, 1)
            return held + sum(n for _, n in sent), requests
        return (requests,)

    def prefill_load(self, info: InstanceInfo) -> tuple[int, ...]:
        return (self._prefill_in_flight.get(info.instance_id, 0),)

    def pick_decode(self, exclude: Iterable[str] = (), revision: str | None = None) -> InstanceInfo:
        """The decode rank to use (module docstring), of `revision` only when given."""
        return self._pick(Role.DECODE, self.decode_load, exclude, revision)

    def pick_prefill(
        self, exclude: Iterable[str] = (), revision: str | None = None
    ) -> InstanceInfo:
        return self._pick(Role.PREFILL, self.prefill_load, exclude, revision)

    def decode_revision(self, exclude: Iterable[str] = ()) -> str:
        """The revision a disaggregated request is served at (`routing.choose_revision` over the
        routable decode ranks not in `exclude`); `NoInstance` when there is none."""
        excluded = set(exclude)
        decodes = [i for i in self.ready(Role.DECODE) if i.instance_id not in excluded]
        if not decodes:
            raise NoInstance("no ready decode instance" + (" left to try" if excluded else ""))
        prefill_revisions = {i.revision for i in self.ready(Role.PREFILL)}
        return choose_revision(
            [(i.revision, self.decode_load(i)) for i in decodes], prefill_revisions
        )

    def _pick(
        self,
        role: Role,
        load: Callable[[InstanceInfo], tuple[int, ...]],
        exclude: Iterable[str],
        revision: str | None = None,
    ) -> InstanceInfo:
        excluded = set(exclude)
        candidates = [i for i in self.ready(role, revision) if i.instance_id not in excluded]
        if not candidates:
            of = f" of revision {revision or '(none)'}" if revision is not None else ""
            left = " left to try" if excluded else ""
            raise NoInstance(f"no ready {role} instance{of}{left}")
        best = min(load(i) for i in candidates)
        tied = [i for i in candidates if load(i) == best]
        last = self._last.get(role, "")
        choice = next((i for i in tied if i.instance_id > last), tied[0])
        self._last[role] = choice.instance_id
        return choice

    def note_sent(self, instance_id: str, now_ms: int | None = None, tokens: int = 0) -> None:
        """A request with `tokens` prompt tokens went to this decode rank (counted until a later
        heartbeat)."""
        sent = (_now_ms() if now_ms is None else now_ms, tokens)
        self._sent.setdefault(instance_id, []).append(sent)

    def prefill_started(self, instance_id: str) -> None:
        self._prefill_in_flight[instance_id] = self._prefill_in_flight.get(instance_id, 0) + 1

    def prefill_finished(self, instance_id: str) -> None:
        left = self._prefill_in_flight.get(instance_id, 0) - 1
        if left > 0:
            self._prefill_in_flight[instance_id] = left
        else:
            self._prefill_in_flight.pop(instance_id, None)


def _routable(info: InstanceInfo) -> bool:
    return info.ready and not info.draining


def _resolve(future: asyncio.Future[None]) -> None:
    with suppress(asyncio.InvalidStateError, RuntimeError):  # cancelled, or its loop closed
        future.set_result(None)


async def refresh_forever(
    router: Router, fetch: Callable[[], Awaitable[list[InstanceInfo]]], interval_s: float = 0.5
) -> None:
    """Feed `fetch()` (the registry's instances) to the router every interval; errors keep the old
    view."""
    while True:
        try:
            router.update(await fetch())
            router.refresh_error = None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - Redis down: keep routing on the last view
            if router.refresh_error is None:
                log.warning("registry refresh failed", error=f"{type(e).__name__}: {e}")
            router.refresh_error = f"{type(e).__name__}: {e}"
        await pause(interval_s)


def health(router: Router, needs_prefill: bool) -> tuple[str, dict[str, object]]:
    """The gateway's health: "unavailable" when no decode rank is ready (nothing can be served),
    "degraded" when requests are served but the registry cannot be read (Redis down: routing on the
    last view), or the mesh lacks its kvstore or (`needs_prefill`: disagg) its prefill ranks (decode
    then prefills itself), else "ok"; with the counts and problems behind it."""
    counts = {str(role): len(router.ready(role)) for role in (Role.DECODE, Role.PREFILL)}
    counts["kvstore"] = len(router.ready(Role.KVSTORE))
    problems = []
    if router.refresh_error is not None:
        problems.append(f"registry unreachable ({router.refresh_error}); routing on the last view")
    if needs_prefill and not counts["kvstore"]:
        problems.append("no kvstore instance is registered: KV hand-offs cannot be recorded")
    if needs_prefill and not counts["prefill"]:
        problems.append("no prefill rank is ready: decode ranks prefill themselves")
    if not counts["decode"]:
        status = "unavailable"
        problems.insert(0, "no decode rank is ready")
    else:
        status = "degraded" if problems else "ok"
    return status, {**counts, "problems": problems}
