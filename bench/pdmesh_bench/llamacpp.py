"""llama.cpp's figures beside the engine's: runs a `llama-batched-bench` binary on a GGUF of the
same checkpoint and reads its table (for `pdmesh bench engine --against llama.cpp`).

llama-batched-bench runs B sequences of PP prompt tokens each (not shared), then TG generated
tokens each, for every B of `-npl`, and prints one markdown row per B:

    | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |

Decode throughput is S_TG = B * TG / T_TG (output tokens per second over the generation phase),
the decode step T_TG / TG. Its default settings are kept (flash attention as the build decides, its
own batch sizes); `threads` is passed as `-t`, and the context as `-c` (large enough for the largest
B). Nothing of llama.cpp is installed by this project: the caller names the binary and the GGUF.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_ROW = re.compile(r"^\|\s*\d")


@dataclass(frozen=True)
class BatchedBenchRow:
    prompt_len: int  # PP
    output_len: int  # TG
    batch: int  # B
    prefill_s: float  # T_PP
    prefill_tokens_per_s: float  # S_PP
    decode_s: float  # T_TG
    decode_tokens_per_s: float  # S_TG

    @property
    def step_ms(self) -> float:
        """One decode step (all B sequences advance one token)."""
        return 1e3 * self.decode_s / self.output_len


def batched_bench_argv(
    binary: Path,
    gguf: Path,
    input_len: int,
    output_len: int,
    concurrencies: Sequence[int],
    threads: int,
) -> list[str]:
    context = max(concurrencies) * (input_len + output_len) + 64
    return [
        str(binary),
        "-m",
        str(gguf),
        "-c",
        str(context),
        "-npp",
        str(input_len),
        "-ntg",
        str(output_len),
        "-npl",
        ",".join(str(c) for c in concurrencies),
        "-t",
        str(threads),
    ]


def parse_batched_bench(text: str) -> list[BatchedBenchRow]:
    """The data rows of llama-batched-bench's table (ValueError when it has none)."""
    rows = []
    for line in text.splitlines():
        if not _ROW.match(line.strip()):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 8:
            continue
        pp, tg, b = (int(c) for c in cells[:3])
        t_pp, s_pp, t_tg, s_tg = (float(c) for c in cells[4:8])
        rows.append(BatchedBenchRow(pp, tg, b, t_pp, s_pp, t_tg, s_tg))
    if not rows:
        raise ValueError("no result rows in llama-batched-bench's output:\n" + text[-2000:])
    return rows


def run_batched_bench(
    binary: Path,
    gguf: Path,
    input_len: int,
    output_len: int,
    concurrencies: Sequence[int],
    threads: int,
    timeout_s: float = 3600.0,
) -> dict[int, BatchedBenchRow]:
    """Run it once; its row per concurrency (B)."""
    argv = batched_bench_argv(binary, gguf, input_len, output_len, concurrencies, threads)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"{binary.name} exited with {done.returncode}: {(done.stderr or done.stdout)[-2000:]}"
        )
    rows = {r.batch: r for r in parse_batched_bench(done.stdout)}
    missing = [c for c in concurrencies if c not in rows]
    if missing:
        raise ValueError(f"llama-batched-bench printed no row for B = {missing}")
    return rows
