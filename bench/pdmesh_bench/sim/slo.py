"""Goodput at SLOs, over the per-request rows both `pdmesh bench serve --json` and `pdmesh sim
--json` write: a request meets the SLOs when it completed, its TTFT is within the TTFT target and
its TPOT ((e2e - TTFT) / (output tokens - 1)) within the TPOT target."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float

    def __str__(self) -> str:
        return f"TTFT <= {self.ttft_ms:g} ms, TPOT <= {self.tpot_ms:g} ms"


def meets(row: Mapping[str, Any], slo: Slo) -> bool:
    if not row.get("ok") or row.get("ttft_ms") is None:
        return False
    n = int(row.get("output_tokens") or 0)
    tpot = (row["e2e_ms"] - row["ttft_ms"]) / (n - 1) if n > 1 else 0.0
    return bool(row["ttft_ms"] <= slo.ttft_ms and tpot <= slo.tpot_ms)


def goodput(result: Mapping[str, Any], slo: Slo) -> dict[str, Any]:
    """The share of requests that met the SLOs (`attainment`, errors count as missed) and their
    output tokens per second over the run."""
    rows: Sequence[Mapping[str, Any]] = result["requests"]
    good = [r for r in rows if meets(r, slo)]
    duration = max(float(result["duration_s"]), 1e-9)
    return {
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "attainment": len(good) / len(rows) if rows else None,
        "goodput_tokens_per_s": sum(int(r["output_tokens"]) for r in good) / duration,
        "goodput_requests_per_s": len(good) / duration,
    }
