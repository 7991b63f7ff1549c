"""TTFT plots for `pdmesh bench serve`: the empirical CDF of time to first token, one curve per run.

A run is the dict `--json` writes: its `requests` rows (`ttft_ms` of the completed ones) make one
curve; a `--dp-replay` run (`dp_replay.replays`, each with its own rows) makes one curve per replay
(mirror, lag, ...). A run's label is its `config.label`, else its JSON file's name. Matplotlib runs
headless (Agg), imported only when a plot is written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Curve = tuple[str, list[float]]  # (label, TTFT ms of the completed requests)


def load_result(path: str | Path) -> dict[str, Any]:
    """A saved `--json` result (ValueError if it is not one)."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a bench serve result: {e}") from None
    if not isinstance(result, dict) or ("requests" not in result and "dp_replay" not in result):
        raise ValueError(f"{path}: no per-request rows (`requests`): not a bench serve --json")
    return result


def run_label(result: dict[str, Any], path: str | Path | None = None) -> str:
    """`config.label`, else the JSON file's name without its suffix, else "this run"."""
    label = (result.get("config") or {}).get("label")
    if label:
        return str(label)
    return Path(path).stem if path else "this run"


def ttft_values(rows: Sequence[dict[str, Any]]) -> list[float]:
    """TTFT (ms) of the completed rows, sorted."""
    return sorted(float(r["ttft_ms"]) for r in rows if r.get("ok") and r.get("ttft_ms") is not None)


def ttft_curves(result: dict[str, Any], label: str) -> list[Curve]:
    """One curve for a plain run; one per replay ("label mirror", "label lag", ...) for a
    dp-replay run."""
    replay = result.get("dp_replay")
    if replay is None:
        return [(label, ttft_values(result.get("requests") or []))]
    return [
        (f"{label} {r['name']}", ttft_values(r.get("requests") or [])) for r in replay["replays"]
    ]


def compare_curves(paths: Sequence[str | Path]) -> list[Curve]:
    """The curves of saved runs, each labelled by `run_label`."""
    curves: list[Curve] = []
    for path in paths:
        result = load_result(path)
        curves += ttft_curves(result, run_label(result, path))
    return curves


def ecdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """(x, y) of the empirical CDF as steps: y = i / n at the i-th smallest value."""
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def is_log_scale(curves: Sequence[Curve]) -> bool:
    """Log-x when the positive TTFTs span more than a factor of 20."""
    values = [v for _, vs in curves for v in vs if v > 0]
    return bool(values) and max(values) / min(values) > 20


def write_ttft_plot(
    path: str | Path, curves: Sequence[Curve], title: str = "TTFT, empirical CDF"
) -> Path:
    """Draw the curves' CDFs (ms on x) into a PNG; curves without values are listed as "(none)".
    ValueError when no curve has a value."""
    if not any(values for _, values in curves):
        raise ValueError("no completed request to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    is_crowded = len(curves) > 4  # the legend goes beside the axes
    fig, ax = plt.subplots(figsize=(10.5 if is_crowded else 7, 4.5))
    for label, values in curves:
        style = "--" if " lag" in label else "-"  # dp-replay: lag replays dashed, mirrors solid
        if not values:
            ax.plot([], [], style, label=f"{label} (none)")
            continue
        xs, ys = ecdf(values)
        p50 = xs[max(0, math.ceil(0.5 * len(xs)) - 1)]
        ax.step(xs, ys, style, where="post", label=f"{label} (n={len(xs)}, p50 {p50:.0f} ms)")
    if is_log_scale(curves):
        ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if is_crowded:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    else:
        ax.legend(loc="lower right", fontsize="small")
    return save_figure(fig, path)


def save_figure(fig: Any, path: str | Path) -> Path:
    """Write a matplotlib figure to a PNG (its folder made) and close it."""
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
