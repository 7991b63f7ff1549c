"""Swapping the logical→physical expert placement of a running model, at a step boundary.

    new placements (one per MoE layer)
      -> per layer: the local slots whose logical expert changes
      -> their weights from `load_tensor(checkpoint name)` (the checkpoint via `CheckpointTensors`,
         or memory)
      -> copied into w13 [P_local, 2I, D] / w2 [P_local, D, I]; then `MoE.set_placement`

Contract: every DEP rank applies the same placements between the same two steps (no forward in
flight); each rank loads only the experts entering its own slots. The MTP layer follows the last MoE
layer.

Staged switching without stalling the step (`PlacementStager`, driven by `EngineCore`):

    request(version, rows [L][P])           engine thread; returns at once
      -> background thread, layer by layer: the local slots whose expert changes get spare buffers
         ([C, 2I, D] / [C, D, I], C = changed local slots of that layer), filled from another local
         slot holding that expert (a copy) or from the checkpoint (one expert's tensors at a time)
      -> ready: `staged_version = version`
    switch_to(version)                       engine thread, at a step boundary (no forward in
                                             flight):
      -> index_copy the buffers into w13/w2, `MoE.set_placement` on every target layer, buffers
         freed

Only the decoder's MoE layers (the "target") are staged; the MTP layers' MoE keeps its own
placement. Threading contract: the staging thread only reads w13/w2 of the running placement, which
does not change while a job runs (a request discards any ready stage, and only a ready stage is
switched in); it publishes its result under the lock unless a newer request cancelled it. A newer
request cancels the running job, whose thread the new job joins before it starts (at most one
expert's read later).

A model may say which of its layers are placed and how its checkpoint names an expert's tensors:
DeepSeek-V4's `placed_moe_layers()` (its decoder layers, `ffn`) and `expert_source(tensors)` (any
of its checkpoint layouts, dequantised); V3's are the functions here (`mlp` layers, V3's names).

Legend: P_local slots on this rank, I expert width, D hidden, L target MoE layers, P physical slots.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pdmesh_engine.checkpoint import tensor_names
from pdmesh_engine.config import CheckpointError
from pdmesh_engine.model.deepseek_v3.model import DeepseekV3ForCausalLM
from pdmesh_engine.model.moe import (
    EXPERT_PARTS,
    ExpertLoadRecorder,
    ExpertPlacement,
    MoE,
    PlacedExperts,
    write_expert_part,
)

TensorSource = Callable[[str], torch.Tensor]  # checkpoint tensor name -> tensor
# (checkpoint layer, logical expert, part) -> one expert's checkpoint tensor
ExpertSource = Callable[[int, int, str], torch.Tensor]
STAGING_NICE = 10  # the staging thread's CPU priority offset (Linux threads)


def expert_tensor_name(checkpoint_layer: int, logical: int, part: str) -> str:
    return f"model.layers.{checkpoint_layer}.mlp.experts.{logical}.{part}.weight"


def target_moe_layers(model: Any) -> list[tuple[int, PlacedExperts]]:
    """(checkpoint layer index, MoE) for the decoder's MoE layers (what a `PlacementStager`
    places): a model's own `placed_moe_layers()` where it has one (DeepSeek-V4), else V3's `mlp`
    layers."""
    if hasattr(model, "placed_moe_layers"):
        layers: list[tuple[int, PlacedExperts]] = model.placed_moe_layers()
        return layers
    return [
        (i, layer.mlp)
        for i, layer in enumerate(model.layers)
        if isinstance(getattr(layer, "mlp", None), MoE)
    ]


def moe_layers_by_checkpoint_index(model: Any) -> list[tuple[int, PlacedExperts]]:
    """`target_moe_layers`, then V3's MTP layers' (index L + j; V4's MTP layer is not placed)."""
    out = target_moe_layers(model)
    if hasattr(model, "placed_moe_layers"):
        return out
    base = model.config.num_hidden_layers
    out += [
        (base + j, mtp.block.mlp)
        for j, mtp in enumerate(model.mtp)
        if isinstance(mtp.block.mlp, MoE)
    ]
    return out


class CheckpointTensors:
    """Reads single tensors by name from a safetensors checkpoint: the header index is built once
    and each file is opened (memory-mapped) once, on first use, so one expert's read is a copy out
    of the page cache."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.files = tensor_names(model_dir)
        self._handles: dict[Path, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, name: str) -> torch.Tensor:
        file = self.files.get(name)
        if file is None:
            raise CheckpointError(f"checkpoint has no tensor {name!r}")
        try:
            with self._lock:
                handle = self._handles.get(file)
                if handle is None:
                    handle = self._handles[file] = safe_open(
                        str(file), framework="pt", device="cpu"
                    )
                return handle.get_tensor(name)
        except (OSError, SafetensorError) as e:
            raise CheckpointError(f"{file}: cannot read {name!r} ({e})") from e


def expert_source(model: Any, load_tensor: TensorSource) -> ExpertSource:
    """How `model`'s experts are read through `load_tensor`: the model's own `expert_source` where
    it has one (DeepSeek-V4, over a `CheckpointTensors`), else by V3's tensor names."""
    if hasattr(model, "expert_source"):
        source: ExpertSource = model.expert_source(load_tensor)
        return source
    return lambda layer, logical, part: load_tensor(expert_tensor_name(layer, logical, part))


def _write_slot(
    moe: PlacedExperts, local: int, checkpoint_layer: int, logical: int, source: ExpertSource
) -> None:
    for part in EXPERT_PARTS:
        moe.write_slot(local, part, source(checkpoint_layer, logical, part))


def apply_placement(
    model: DeepseekV3ForCausalLM,
    new_placements: Sequence[ExpertPlacement],
    load_tensor: TensorSource,
) -> int:
    """Adopt one placement per MoE layer (in `model.moe_layers` order); returns the local slots
    reloaded."""
    layers = moe_layers_by_checkpoint_index(model)
    num_decoder = len(model.moe_layers)
    if len(new_placements) != num_decoder:
        raise ValueError(
            f"need one placement per MoE layer ({num_decoder}), got {len(new_placements)}"
        )
    source = expert_source(model, load_tensor)
    reloaded = 0
    for index, (checkpoint_layer, moe) in enumerate(layers):
        placement = new_placements[min(index, num_decoder - 1)]
        if placement.num_physical != moe.placement.num_physical:
            raise ValueError(
                f"layer {checkpoint_layer}: placement has {placement.num_physical} slots, "
                f"the model {moe.placement.num_physical}"
            )
        old = moe.placement.physical_to_logical.tolist()
        new = placement.physical_to_logical.tolist()
        for slot in moe.local_slots:
            if old[slot] != new[slot]:
                _write_slot(moe, slot - moe.local_slots.start, checkpoint_layer, new[slot], source)
                reloaded += 1
        moe.set_placement(placement)
    return reloaded


@dataclass(frozen=True)
class StagingStats:
    """What staging one placement version cost on this rank (all target layers)."""

    version: int
    num_changed_slots: int  # local slots whose logical expert changes
    num_copied: int  # of those, filled from this rank's memory (another local slot)
    num_from_checkpoint: int  # of those, read from the checkpoint (3 tensors each)
    num_bytes: int  # the spare buffers' size
    seconds: float  # wall time of the background staging


@dataclass(frozen=True)
class StagedLayer:
    """One target layer's staged change: the local slots whose expert changes and their new
    weights."""

    moe: PlacedExperts
    local_ids: torch.Tensor  # [C] int64, indices into w13/w2 (on the weights' device)
    w13: torch.Tensor  # [C, 2I, D]
    w2: torch.Tensor  # [C, D, I]


@dataclass(frozen=True)
class StagedPlacement:
    """A fully staged version: every target layer's new placement and its changed slots' weights."""

    version: int
    placements: tuple[ExpertPlacement, ...]  # one per target layer (`PlacementStager.layers` order)
    layers: tuple[StagedLayer, ...]  # only layers with changed local slots
    stats: StagingStats


class _Job:
    """One background staging run; `previous` is the job it replaced (joined before this one
    starts)."""

    def __init__(
        self, version: int, placements: list[ExpertPlacement], previous: _Job | None
    ) -> None:
        self.version, self.placements, self.previous = version, placements, previous
        self.cancelled = threading.Event()
        self.thread = threading.Thread(target=lambda: None, daemon=True)

    @property
    def is_live(self) -> bool:
        return self.thread.is_alive() and not self.cancelled.is_set()


class PlacementStager:
    """Stages target placements in the background and switches them in at a step boundary (module
    docstring).

    `request`, `ready_version`, `switch_to` run on the engine thread; `running_version` is the
    placement in use (0: the checkpoint's initial one), `staged_version` the ready one (= running
    when none is ready).
    """

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        load_tensor: TensorSource,
        expert_load: ExpertLoadRecorder | None = None,
    ) -> None:
        self.layers = target_moe_layers(model)
        self.expert_source, self.expert_load = expert_source(model, load_tensor), expert_load
        self.running_version = 0
        self.last_stats: StagingStats | None = None  # of the last version that finished staging
        self.last_error = ""  # why the last staging run failed ("" if it did not)
        self._lock = threading.Lock()
        self._ready: StagedPlacement | None = None
        self._job: _Job | None = None

    @property
    def staged_version(self) -> int:
        ready = self._ready
        return ready.version if ready is not None else self.running_version

    @property
    def is_staging(self) -> bool:
        job = self._job
        return job is not None and job.is_live

    def ready_version(self) -> int:
        """The version a switch would adopt now; 0 while nothing is ready. Once ready, it stays
        until `switch_to` or a newer `request` (both on the engine thread): no job runs while one is
        ready."""
        ready = self._ready
        return ready.version if ready is not None else 0

    def request(self, version: int, physical_to_logical: Sequence[Sequence[int]]) -> bool:
        """Start staging `version` in the background; False if it is not newer than the running,
        staged or staging version or its shape is not [L][P]. ValueError for a row that misses an
        expert."""
        placements = self._placements(physical_to_logical)
        if placements is None:
            return False
        with self._lock:
            job = self._job
            staging = job.version if job is not None and job.is_live else 0
            if version <= max(self.running_version, self.staged_version, staging):
                return False
            if job is not None:
                job.cancelled.set()
            self._ready = None  # a newer version replaces a ready, unswitched one
            self._job = new = _Job(version, placements, job)
            new.thread = threading.Thread(
                target=self._run, args=(new,), name=f"eplb-stage-v{version}", daemon=True
            )
            new.thread.start()
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the running job (if any) ended; True if none is running now (tests,
        shutdown)."""
        job = self._job
        if job is not None:
            job.thread.join(timeout_s)
        return not (job is not None and job.thread.is_alive())

    def reset(self) -> None:
        """Drop what is staged or staging (its buffers fit slots that are about to change: an
        elastic DEP instance re-splits them); the running version stays. Engine thread."""
        with self._lock:
            job, self._job, self._ready = self._job, None, None
        if job is not None:
            job.cancelled.set()
            job.thread.join()

    def switch_to(self, version: int) -> None:
        """Adopt the ready `version`: copy its buffers into w13/w2, set every target layer's
        placement, free the buffers, restart the expert-load ring. Engine thread, between two
        forwards."""
        with self._lock:
            staged = self._ready
            if staged is None or staged.version != version:
                raise RuntimeError(
                    f"placement version {version} is not the staged one ({self.ready_version()})"
                )
            self._ready = None
        with torch.no_grad():
            for layer in staged.layers:
                layer.moe.w13.data.index_copy_(0, layer.local_ids, layer.w13)
                layer.moe.w2.data.index_copy_(0, layer.local_ids, layer.w2)
                if layer.w13.is_cuda:  # allocated on the staging stream, read on this one
                    layer.w13.record_stream(torch.cuda.current_stream(layer.w13.device))
                    layer.w2.record_stream(torch.cuda.current_stream(layer.w2.device))
        for (_, moe), placement in zip(self.layers, staged.placements, strict=True):
            moe.set_placement(placement)
        if self.expert_load is not None:
            self.expert_load.restart()  # counts under the old placement must not mix with the new
        self.running_version = staged.version

    def _placements(self, rows: Sequence[Sequence[int]]) -> list[ExpertPlacement] | None:
        if not self.layers or len(rows) != len(self.layers):
            return None
        moe = self.layers[0][1]
        num_physical, num_logical = (
            moe.placement.num_physical,
            int(moe.placement.replica_counts.shape[0]),
        )
        if any(len(row) != num_physical for row in rows):
            return None
        return [ExpertPlacement.from_slots([int(e) for e in row], num_logical) for row in rows]

    def _run(self, job: _Job) -> None:
        _yield_to_the_forward()
        previous, job.previous = job.previous, None
        if previous is not None:
            previous.thread.join()
        start = time.perf_counter()
        try:
            staged = self._stage(job, start)
        except Exception as e:  # noqa: BLE001 - a failed run leaves nothing staged; the caller may retry
            with self._lock:
                if self._job is job:
                    self.last_error = (
                        f"staging version {job.version} failed: {type(e).__name__}: {e}"
                    )
            return
        with self._lock:
            if staged is not None and not job.cancelled.is_set():
                self._ready, self.last_stats, self.last_error = staged, staged.stats, ""

    @torch.no_grad()
    def _stage(self, job: _Job, start: float) -> StagedPlacement | None:
        """Every target layer in turn (None once cancelled); on a GPU, on a side stream."""
        layers: list[StagedLayer] = []
        counts = [0, 0]  # [copied, from checkpoint]
        device = self.layers[0][1].w13.device
        with _staging_stream(device) as stream:
            for (checkpoint_layer, moe), placement in zip(self.layers, job.placements, strict=True):
                if job.cancelled.is_set():
                    return None
                layer = self._stage_layer(checkpoint_layer, moe, placement, counts)
                if layer is not None:
                    layers.append(layer)
            if stream is not None:
                stream.synchronize()
        num_bytes = sum(layer.w13.nbytes + layer.w2.nbytes for layer in layers)
        stats = StagingStats(
            job.version,
            sum(len(layer.local_ids) for layer in layers),
            counts[0],
            counts[1],
            num_bytes,
            time.perf_counter() - start,
        )
        return StagedPlacement(job.version, tuple(job.placements), tuple(layers), stats)

    def _stage_layer(
        self,
        checkpoint_layer: int,
        moe: PlacedExperts,
        placement: ExpertPlacement,
        counts: list[int],
    ) -> StagedLayer | None:
        """Buffers for the local slots of `moe` whose expert changes; None if none does."""
        old, new = moe.slot_experts, placement.physical_to_logical.tolist()
        start = moe.local_slots.start
        changed = [slot for slot in moe.local_slots if old[slot] != new[slot]]
        if not changed:
            return None
        # logical -> (w13, w2, index)
        in_memory: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        for slot in moe.local_slots:
            in_memory.setdefault(old[slot], (moe.w13.data, moe.w2.data, slot - start))
        w13 = torch.empty(
            (len(changed), *moe.w13.shape[1:]), dtype=moe.w13.dtype, device=moe.w13.device
        )
        w2 = torch.empty(
            (len(changed), *moe.w2.shape[1:]), dtype=moe.w2.dtype, device=moe.w2.device
        )
        for index, slot in enumerate(changed):
            source = in_memory.get(new[slot])
            if source is not None:
                w13[index].copy_(source[0][source[2]])
                w2[index].copy_(source[1][source[2]])
                counts[0] += 1
            else:
                for part in EXPERT_PARTS:
                    tensor = self.expert_source(checkpoint_layer, new[slot], part)
                    write_expert_part(w13, w2, index, part, tensor)
                counts[1] += 1
                in_memory[new[slot]] = (w13, w2, index)
        local_ids = torch.tensor(
            [slot - start for slot in changed], dtype=torch.int64, device=moe.w13.device
        )
        return StagedLayer(moe, local_ids, w13, w2)


@dataclass(frozen=True)
class ExpertModel:
    """One model whose routed experts EPLB balances on this rank (the target, or a speculative
    draft model): its MoE layers' load ring and its placement stager."""

    model: DeepseekV3ForCausalLM
    expert_load: ExpertLoadRecorder | None
    stager: PlacementStager
    window: int  # the load ring's size in steps (the engine's `expert_load_window`)

    @property
    def num_logical(self) -> int:
        return self.model.config.n_routed_experts

    @property
    def bytes_per_expert(self) -> int:
        """Bytes of one routed expert's weights (w13 + w2 of one slot); 0 without MoE layers."""
        moe = self.model.moe_layers
        return int(moe[0].w13[0].nbytes + moe[0].w2[0].nbytes) if moe else 0

    def load_steps(self) -> tuple[int, int]:
        """(forward steps recorded since start, that count when the running placement was switched
        in)."""
        recorder = self.expert_load
        return (recorder.step, recorder.restart_step) if recorder is not None else (0, 0)

    def load_window(self) -> tuple[int, int, list[list[int]]]:
        """(steps recorded since the last switch, capped at the window; the window; [L][P] tokens
        per slot routed by this rank over those steps), with one host sync for all layers."""
        recorder = self.expert_load
        if recorder is None:
            return 0, self.window, []
        counts: list[list[int]] = recorder.window_totals().tolist()
        return min(recorder.steps_since_restart, recorder.window), recorder.window, counts


def _yield_to_the_forward() -> None:
    """Staging is background work: on Linux this thread takes a lower CPU priority than the step's
    threads, so on few cores it runs in their idle time instead of stretching the steps it
    overlaps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), STAGING_NICE)
    except (
        AttributeError,
        OSError,
    ):  # not Linux, or not permitted: staging still works, just less politely
        pass


@contextlib.contextmanager
def _staging_stream(device: torch.device) -> Iterator[torch.cuda.Stream | None]:
    """A side CUDA stream for the staging copies (the forward keeps the default one); nothing on a
    CPU."""
    if device.type != "cuda":
        yield None
        return
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        yield stream
