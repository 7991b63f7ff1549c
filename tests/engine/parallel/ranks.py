"""What the DEP tests share: ranks run as spawned processes that rendezvous on a free loopback port
and leave their results as `<name>-<rank>.pt` files for the parent to read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

from pdmesh_service.redis_server import free_port


def spawn(fn: Callable, nprocs: int, *args) -> None:
    """Run fn(rank, nprocs, port, *args) in `nprocs` processes and wait for all."""
    mp.spawn(fn, args=(nprocs, free_port(), *args), nprocs=nprocs, join=True)


def load_results(out_dir: Path, name: str, nprocs: int) -> list[dict]:
    """What each rank saved as `<name>-<rank>.pt` under out_dir, by rank."""
    return [torch.load(out_dir / f"{name}-{rank}.pt", weights_only=False) for rank in range(nprocs)]
