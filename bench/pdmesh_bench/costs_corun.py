"""How much two busy ranks on one CPU host slow each other (`pdmesh bench costs`'
`hardware.corun_slowdown`): cores that share caches, memory bandwidth or a physical core (two
vCPUs of one) make a 1-thread step slower while another worker process computes beside it, which
a count of busy threads against cores does not see.

    solo   decode steps of B requests at 1 thread, alone
    corun  the same while a second process (this module run as a script: `python -m
           pdmesh_bench.costs_corun MODEL`) runs 1-thread prefill steps of a 512-token prompt
           in a loop
    corun_slowdown = median corun / median of the solo runs before and after
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from pdmesh_bench.costs_steps import StepBench, median_time

READY = "corun ready"
BUSY_PROMPT = 512


def measure_corun(
    bench: StepBench, model_dir: Path, batch: int, warmup: int, repeats: int
) -> tuple[float, str]:
    """(corun_slowdown, its note), at 1 thread with a 1-thread prefill loop beside."""

    def solo() -> float:
        return median_time(bench.decode(batch, 32, warmup, repeats), 1)[0]

    before = solo()
    busy = subprocess.Popen(
        [sys.executable, "-m", "pdmesh_bench.costs_corun", str(model_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = busy.stdout.readline() if busy.stdout else ""
        if READY not in line:
            raise RuntimeError(f"the co-running process did not start: {line!r}")
        time.sleep(1.0)  # into its loop
        together = median_time(bench.decode(batch, 32, warmup, repeats), 1)[0]
    finally:
        busy.kill()
        busy.wait()
    after = solo()
    alone = statistics.fmean([before, after])
    factor = max(1.0, together / alone)
    note = (
        f"decode batch {batch} at 1 thread: alone {before * 1e3:.2f} / {after * 1e3:.2f} ms "
        f"(before / after), beside a 1-thread process prefilling {BUSY_PROMPT}-token prompts "
        f"{together * 1e3:.2f} ms: x{together / alone:.2f} (clamped >= 1)"
    )
    return factor, note


def busy_loop(model_dir: Path, seconds: float = 600.0) -> None:
    """Prefill steps at 1 thread until killed (or `seconds`)."""
    from pdmesh_engine.config import EngineConfig
    from pdmesh_engine.engine_core import EngineCore
    from pdmesh_engine.sampling import SamplingParams

    torch.set_num_threads(1)
    engine = EngineCore(model_dir, EngineConfig(num_threads=1))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    print(READY, flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        engine.add_request(torch.randint(16, vocab, (BUSY_PROMPT,)).tolist(), params)
        while engine.has_unfinished:
            engine.step()


if __name__ == "__main__":
    busy_loop(Path(sys.argv[1]))
