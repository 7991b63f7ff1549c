"""DEP: data-parallel attention + expert parallelism, one rank process per attention replica.

Each rank owns its requests (its own scheduler and KV pool), a full copy of attention, dense layers
and shared experts, and a contiguous 1/n share of the routed experts' physical slots. The ranks meet
inside every MoE layer (the `AllToAllDispatcher`), so they must run the same number of forward
passes:

    EngineCore.step() on every rank, in lockstep:
      schedule locally -> DP sync: all_reduce([has_work, num_tokens, num_unfinished, stop, join])
      int64 [5] (+ the placement switch's triples, below)
        -> no rank has work:        return {} without a forward (the caller idles)
        -> this rank has no work:   DUMMY forward (1 token into the reserved scratch block)
        -> else:                    the real batch

Speculative decoding: a speculating rank runs, after the target's forward (real or dummy), the
proposer's `num_passes` passes (MTP: K; draft model: K + 1; pdmesh_engine.spec_proposer), padded
with dummy passes where its requests draft less or it has none, so the step's collective sequence
is the same on every rank; no collective is added (the count is a function of K and the method).
The draft model's MoE runs on the same dispatcher with its own placement (`draft_model_kwargs`:
its routed experts split across the ranks like the target's).

`stop`: a rank that calls `LockstepStepper.request_stop()` makes every rank's record of that step
say `stop` (after its forward, if any), so a serving instance's ranks leave the collective sequence
at the same step.

Placement switch (EPLB): the same all-reduce also carries [is_staged, V, V*V], where V is the
placement version this rank has staged and ready (0, 0, 0 when none). Every rank switches to V in
this step, before its forward, iff sum(is_staged) == size and size * sum(V*V) == sum(V)**2 (all
ranks hold the same V: the variance of the V's is zero); V = sum(V) / size. The rule is a function
of the sums only, so every rank takes the same decision in the same step; no collective is added.
Versions stay far below 2**28. A speculating rank's draft model has placements of its own: its
[is_staged, V, V*V] follow the target's in the same all-reduce and the same rule decides its switch
(`LockstepRecord.draft_switched_to`).

Elastic (`DEPContext.elastic`, pdmesh_engine.parallel.elastic): a failed collective re-forms the
group over the survivors and the step is run again (`LockstepStepper.recover`); `join` says a
restarted rank waits to join (`LockstepRecord.regroup`: every rank re-forms after this step).

The rendezvous (a TCPStore on rank 0) listens on `master_addr` only. Gloo's pair sockets use the
network interface `DEPConfig.gloo_interface` (by default: the loopback interface for a loopback
master), given to gloo as a device of the process group's options (`gloo_backend`), not through the
environment.

Setup: `init_dep(DEPConfig(...))` -> `DEPContext`; `EngineCore(model_dir, config, dep=context)`
builds the model with this rank's slots and the dispatcher, reserves the scratch block and drives
`LockstepStepper`. The offline driver that steps such an engine to completion is
`pdmesh_engine.llm.run_lockstep`.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from pdmesh_engine.config import ModelConfig
from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.model.deepseek_v4.config import V4Config
from pdmesh_engine.model.moe import ExpertDispatcher, ExpertPlacement
from pdmesh_engine.parallel.allreduce import DP_SYNC_IMPLS, DPSync, make_dp_sync
from pdmesh_engine.parallel.dispatch import DISPATCHERS, DispatchStats, make_dispatcher

if TYPE_CHECKING:
    from pdmesh_engine.model_runner import ModelRunner
    from pdmesh_engine.request import Request
    from pdmesh_engine.scheduler import SampledToken, SchedulerOutput, SpecTokens

# gloo_interface: the loopback interface for a loopback master, else gloo's default
AUTO_INTERFACE = "auto"


@dataclass(frozen=True)
class DEPConfig:
    """One rank of a DEP instance. `size` ranks meet at tcp://master_addr:master_port (loopback by
    default)."""

    rank: int
    size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    backend: str = "gloo"
    dp_sync: str = "recursive_doubling"  # see pdmesh_engine.parallel.allreduce.DP_SYNC_IMPLS
    dispatcher: str = "all_to_all"  # see pdmesh_engine.parallel.dispatch.DISPATCHERS
    num_redundant_experts: int = 0  # extra physical slots per MoE layer (replicas)
    timeout_s: float = 600.0  # a collective waiting longer raises instead of hanging
    gloo_interface: str | None = (
        AUTO_INTERFACE  # gloo's pair sockets (e.g. "lo", "eth0"); None: gloo's default
    )

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"DEP needs 0 <= rank < size, got rank {self.rank}, size {self.size}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        check_dep_choices(self.dp_sync, self.num_redundant_experts)
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(
                f"unknown dispatcher {self.dispatcher!r}; choose from {sorted(DISPATCHERS)}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.gloo_interface is not None and not self.gloo_interface:
            raise ValueError("gloo_interface must be an interface name, 'auto' or None, got ''")

    def resolved_gloo_interface(self) -> str | None:
        """The interface gloo binds: "auto" is the loopback interface when `master_addr` is
        loopback."""
        if self.gloo_interface != AUTO_INTERFACE:
            return self.gloo_interface
        return loopback_interface() if _is_loopback(self.master_addr) else None


def check_dep_choices(
    dp_sync: str,
    num_redundant_experts: int,
    dp_sync_name: str = "dp_sync",
    redundant_name: str = "num_redundant_experts",
) -> None:
    """The DEP choices that `DEPConfig` and a service's --dep options share (ValueError naming the
    field as the caller spells it)."""
    if num_redundant_experts < 0:
        raise ValueError(f"{redundant_name} must be >= 0, got {num_redundant_experts}")
    if dp_sync not in DP_SYNC_IMPLS:
        raise ValueError(f"{dp_sync_name} must be one of {sorted(DP_SYNC_IMPLS)}, got {dp_sync!r}")


def slots_of_rank(num_experts: int, num_redundant: int, size: int, rank: int) -> range:
    """This rank's contiguous share of the P = num_experts + num_redundant physical slots."""
    num_physical = num_experts + num_redundant
    if num_physical % size:
        raise ValueError(
            f"{num_experts} routed experts + {num_redundant} redundant slots = {num_physical} "
            f"physical slots do not split evenly across {size} DEP ranks; choose "
            f"num_redundant_experts so that the sum is a multiple of {size}"
        )
    per_rank = num_physical // size
    return range(rank * per_rank, (rank + 1) * per_rank)


class ElasticMembership(Protocol):
    """What a rank of an elastic group offers (`pdmesh_engine.parallel.elastic.ElasticGroup`)."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def join_pending(self) -> bool: ...

    def abort(self) -> None: ...

    def reform(self, expert_models: dict[str, Any], num_redundant: int, failed: bool) -> None: ...


@dataclass
class DEPContext:
    """What a DEP rank holds after `init_dep`: its config, the process groups and the DP sync."""

    config: DEPConfig
    # the MoE all-to-alls (its own group: a GPU backend can differ)
    dispatch_group: dist.ProcessGroup | None
    dp_sync: DPSync  # the per-step all-reduce, on the world group
    dispatcher: ExpertDispatcher = field(init=False)
    # set when the group is elastic (survives a lost rank): pdmesh_engine.parallel.elastic
    elastic: ElasticMembership | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.dispatcher = make_dispatcher(self.config.dispatcher, self.dispatch_group)

    def backend_name(self) -> str:
        """The torch.distributed backend of this rank's groups (gloo on its interface, see
        `gloo_backend`)."""
        return _backend_name(self.config)

    @property
    def dispatch_stats(self) -> DispatchStats | None:
        return getattr(self.dispatcher, "stats", None)

    def model_kwargs(
        self, model_config: ModelConfig | V4Config, num_redundant: int | None = None
    ) -> dict[str, Any]:
        """Keyword arguments of `DeepseekV3ForCausalLM` / `DeepseekV4ForCausalLM`: the initial
        placement, this rank's slots (per MoE layer), the dispatcher. `num_redundant`: redundant
        slots per MoE layer (default: the config's)."""
        num_moe = len(model_config.moe_layer_ids)
        experts = model_config.n_routed_experts
        redundant = self.config.num_redundant_experts if num_redundant is None else num_redundant
        slots = (
            slots_of_rank(experts, redundant, self.config.size, self.config.rank)
            if num_moe
            else range(0)
        )
        placement = ExpertPlacement.initial(experts, redundant) if num_moe else None
        return dict(
            placements=[placement] * num_moe,
            local_slots=[slots] * num_moe,
            dispatcher=self.dispatcher,
        )

    def draft_model_kwargs(self, draft_config: ModelConfig) -> dict[str, Any]:
        """`model_kwargs` of a speculative draft model: its own placement on the same dispatcher,
        each rank holding 1/size of its slots; redundant slots only to pad its experts to a
        multiple of the ranks (`num_redundant_experts` is the target's)."""
        return self.model_kwargs(draft_config, -draft_config.n_routed_experts % self.config.size)


def init_dep(config: DEPConfig) -> DEPContext:
    """Join the DEP process group (all ranks call it), create the dispatch group and the DP sync."""
    backend = _backend_name(config)
    if not dist.is_initialized():
        timeout = timedelta(seconds=config.timeout_s)
        dist.init_process_group(
            backend,
            store=_rendezvous(config, timeout),
            rank=config.rank,
            world_size=config.size,
            timeout=timeout,
        )
    elif (dist.get_rank(), dist.get_world_size()) != (config.rank, config.size):
        raise ValueError(
            f"torch.distributed is already initialised as rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, not rank {config.rank} of {config.size}"
        )
    dispatch_group = dist.new_group(backend=backend)
    return DEPContext(config, dispatch_group, make_dp_sync(config.dp_sync))


def _backend_name(config: DEPConfig) -> str:
    interface = config.resolved_gloo_interface() if config.backend == "gloo" else None
    return gloo_backend(interface) if interface else config.backend


def gloo_backend(interface: str) -> str:
    """The name of a torch.distributed backend that is gloo with its pair sockets on `interface`.

    Torch's built-in "gloo" picks its device from the environment (GLOO_SOCKET_IFNAME) or the
    hostname; this registers (once per interface, through torch's public `Backend.register_backend`)
    a backend that builds the same `ProcessGroupGloo` with an explicit device in its options."""
    name = f"gloo_on_{interface}".lower()
    if name not in dist.Backend.backend_list:

        def create(opts: Any, _backend_options: Any) -> dist.ProcessGroupGloo:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = opts.timeout
            options._devices = [dist.ProcessGroupGloo.create_device(interface=interface)]
            return dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, options)

        dist.Backend.register_backend(name, create, extended_api=True, devices=["cpu"])
    return name


def loopback_interface() -> str | None:
    """This host's loopback interface ("lo" on Linux, "lo0" on macOS), None if there is none."""
    names = [name for _, name in socket.if_nameindex()]
    return next(
        (n for n in names if n == "lo"), next((n for n in names if n.startswith("lo")), None)
    )


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _rendezvous(config: DEPConfig, timeout: timedelta) -> dist.TCPStore:
    """The TCPStore of the group; rank 0 serves it on a socket bound to `master_addr` only (torch's
    own server would listen on every interface)."""
    if config.rank:
        return dist.TCPStore(config.master_addr, config.master_port, config.size, False, timeout)
    family = socket.AF_INET6 if ":" in config.master_addr else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((config.master_addr, config.master_port))
        listener.listen(config.size * 4)
        store = dist.TCPStore(
            config.master_addr,
            config.master_port,
            config.size,
            True,
            timeout,
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the listening socket from here
    return store


def shutdown_dep() -> None:
    """Leave the process group (every rank calls it once its last step is done)."""
    if dist.is_initialized():
        dist.destroy_process_group()


@torch.inference_mode()
def dummy_forward(runner: ModelRunner, scratch_block: int) -> None:
    """One token at position 0 into `scratch_block` (and, for a windowed KV, its per-token rows
    into the window pool's `runner.scratch_window_block`): joins the MoE collectives, records no
    expert load; a speculating runner's proposer then runs its dummy passes (module docstring)."""
    window = runner.scratch_window_block
    batch = ForwardBatch.build(
        [[0]],
        [0],
        [[scratch_block]],
        runner.config.block_size,
        [False],
        runner.device,
        [[window]] if window is not None else None,
    )
    # the dummy token is not load: EPLB must not see it
    runner.model(batch, runner.kv_caches, expert_load=None)
    if runner.expert_load is not None:
        runner.expert_load.end_step()  # an empty row keeps every rank's ring aligned by global step
    if runner.proposer is not None:
        runner.proposer.dummy_step()


@dataclass(frozen=True, slots=True)
class LockstepRecord:
    """One `step()` of a DEP rank: the DP sync's sums over ranks, and what this rank ran."""

    ranks_with_work: int
    num_tokens: int  # scheduled tokens, all ranks
    num_unfinished: int  # requests still running or waiting, all ranks (before this step's outputs)
    local_tokens: int  # this rank's scheduled tokens (0 for a dummy or idle step)
    ran_forward: bool
    dummy: bool
    # some rank asked to stop: every rank leaves the step sequence after this one
    stop: bool = False
    switched_to: int = 0  # the placement version every rank switched to before this step's forward
    draft_switched_to: int = 0  # the same for the draft model's placement
    # elastic: a rank asked to join; every member re-forms the group after this step
    regroup: bool = False


@dataclass
class LockstepCounters:
    steps: int = 0
    forwards: int = 0
    dummies: int = 0
    idle: int = 0
    sync_s: float = 0.0  # time in the DP sync (includes waiting for slower ranks)


class PlacementSwitch(Protocol):
    """What the stepper needs from the engine's placement stager
    (pdmesh_engine.parallel.placement)."""

    def ready_version(self) -> int:
        """The placement version staged and ready to switch to; 0 if none."""
        ...

    def switch_to(self, version: int) -> None:
        """Adopt the ready `version` now (between two forwards)."""
        ...


def agreed_version(num_staged: int, version_sum: int, version_square_sum: int, size: int) -> int:
    """The version every rank switches to in this step (0: none), from the DP sync's sums (module
    docstring)."""
    if (
        num_staged != size
        or version_sum <= 0
        or size * version_square_sum != version_sum * version_sum
    ):
        return 0
    return version_sum // size


class LockstepStepper:
    """The DEP step after scheduling: DP sync, then the real batch, a dummy forward, or nothing.

    With `placement`, a staged placement version is switched in at the step where every one of the
    `size` ranks has it ready (module docstring); `LockstepRecord.switched_to` says when. The same
    for `draft_placement` (a speculating draft model's), `LockstepRecord.draft_switched_to`.
    """

    def __init__(
        self,
        dp_sync: DPSync,
        runner: ModelRunner,
        scratch_block: int,
        placement: PlacementSwitch | None = None,
        size: int = 1,
        draft_placement: PlacementSwitch | None = None,
    ) -> None:
        self.dp_sync, self.runner, self.scratch_block = dp_sync, runner, scratch_block
        self.placement, self.size = placement, size
        self.draft_placement = draft_placement
        self.counters = LockstepCounters()
        self.last: LockstepRecord | None = None
        self.stop_requested = False
        # elastic DEP (pdmesh_engine.parallel.elastic): whether a rank waits to join (polled
        # before each sync), and the re-form after a failed collective (None: a failure raises)
        self.join_pending: Callable[[], bool] = lambda: False
        self.recover: Callable[[], None] | None = None
        self.max_recoveries = 3

    def rebind(self, dp_sync: DPSync, size: int) -> None:
        """Use the re-formed group's DP sync and size from the next step (elastic DEP)."""
        self.dp_sync, self.size = dp_sync, size

    def request_stop(self) -> None:
        """This rank wants to stop: the next step's record says `stop` on every rank."""
        self.stop_requested = True

    def execute(
        self, output: SchedulerOutput, requests: dict[str, Request], num_unfinished: int
    ) -> Mapping[str, SampledToken | SpecTokens]:
        """Every rank calls this once per step, whatever it scheduled (collective). A speculating
        runner's real step is `ModelRunner.execute_spec` (`SpecTokens` per request).

        With `recover` set, a failed collective (RuntimeError: a rank died, a timeout) re-forms
        the group (`recover()`) and the same step is run again, at most `max_recoveries` times."""
        for attempt in range(self.max_recoveries + 1):
            try:
                return self._execute(output, requests, num_unfinished)
            except RuntimeError:
                if self.recover is None or attempt == self.max_recoveries:
                    raise
                self.recover()
        raise AssertionError("unreachable")

    def _execute(
        self, output: SchedulerOutput, requests: dict[str, Request], num_unfinished: int
    ) -> Mapping[str, SampledToken | SpecTokens]:
        start = time.perf_counter()
        switches = (self.placement, self.draft_placement)
        readies = [switch.ready_version() if switch is not None else 0 for switch in switches]
        local = torch.tensor(
            [
                int(not output.is_empty),
                output.num_tokens,
                num_unfinished,
                int(self.stop_requested),
                int(self.join_pending()),
                *(x for ready in readies for x in (int(ready > 0), ready, ready * ready)),
            ],
            dtype=torch.int64,
        )
        self.dp_sync.all_reduce(local)
        sums = local.tolist()
        ranks_with_work, num_tokens, unfinished, stops, joins = sums[:5]
        counters = self.counters
        counters.sync_s += time.perf_counter() - start
        counters.steps += 1
        switched = [
            agreed_version(*sums[5 + 3 * i : 8 + 3 * i], self.size) for i in range(len(switches))
        ]
        for switch, version in zip(switches, switched, strict=True):
            if version and switch is not None:
                switch.switch_to(version)  # every rank, before this step's forward
        switched_to, draft_switched_to = switched
        ran, dummy = ranks_with_work > 0, ranks_with_work > 0 and output.is_empty
        self.last = LockstepRecord(
            ranks_with_work,
            num_tokens,
            unfinished,
            output.num_tokens,
            ran,
            dummy,
            stops > 0,
            switched_to,
            draft_switched_to,
            joins > 0,
        )
        if not ran:
            counters.idle += 1
            self.runner.end_requests(output.finished_ids)
            return {}
        counters.forwards += 1
        if dummy:
            counters.dummies += 1
            self.runner.end_requests(output.finished_ids)
            dummy_forward(self.runner, self.scratch_block)
            return {}
        if self.runner.spec is not None:
            return self.runner.execute_spec(output, requests)
        return self.runner.execute(output, requests)

    @property
    def all_done(self) -> bool:
        """The last step found no rank with work or requests: every rank agrees (same sums)."""
        return (
            self.last is not None
            and self.last.ranks_with_work == 0
            and self.last.num_unfinished == 0
        )
