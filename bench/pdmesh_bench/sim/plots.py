"""PNG plots of a simulated run: TTFT and e2e CDFs, and the gateway's queue over time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdmesh_bench.plots import ecdf, save_figure


def write_run_plot(path: str | Path, result: dict[str, Any], label: str) -> Path:
    """Three panels: TTFT CDF, e2e CDF (ms), queued and running requests over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["requests"] if r.get("ok")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, name in zip(axes[:2], ("ttft_ms", "e2e_ms"), ("TTFT", "e2e"), strict=True):
        values = [float(r[key]) for r in rows if r.get(key) is not None]
        if values:
            xs, ys = ecdf(values)
            ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    queue = result["sim"]["queue_over_time"]
    ax = axes[2]
    if queue:
        times = [q[0] for q in queue]
        ax.step(times, [q[1] for q in queue], where="post", label="waiting at the gateway")
        ax.step(times, [q[2] for q in queue], where="post", label="running on decode")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("requests")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")
    fig.suptitle(f"pdmesh sim: {label}")
    return save_figure(fig, path)
