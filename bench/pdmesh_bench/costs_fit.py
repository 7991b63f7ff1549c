"""The pure arithmetic of `pdmesh bench costs`: least-squares lines and the cost model's
interpolation (no torch, no clock).

    fit_line(xs, ys)              -> (intercept, slope) of ordinary least squares
    fit_shared_slope(groups)      -> one slope shared by several groups, each with its own intercept
    interp(xs, ys, x)             -> piecewise-linear in x, extrapolated linearly past both ends
    attention_tokens(start, n)    -> A of n new tokens from position `start`
    StepModel.step_s(threads, T, A) -> interp(tokens, seconds[threads])(T) + attn[threads] * A
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

Key = TypeVar("Key")


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) minimising sum (y - intercept - slope x)^2; ValueError without two
    distinct x."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values but {len(ys)} y values")
    n = len(xs)
    mean_x = sum(xs) / n if n else 0.0
    mean_y = sum(ys) / n if n else 0.0
    var = sum((x - mean_x) ** 2 for x in xs)
    if n < 2 or var <= 0:
        raise ValueError("a line needs at least two distinct x values")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    return mean_y - slope * mean_x, slope


def fit_shared_slope(groups: Mapping[Key, Sequence[tuple[float, float]]]) -> float:
    """The least-squares slope of y in x shared by every group of (x, y) points, each group with an
    intercept of its own: sum of the within-group covariances / sum of the within-group variances.
    ValueError when no group has two distinct x."""
    covariance = variance = 0.0
    for points in groups.values():
        if not points:
            continue
        mean_x = sum(x for x, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        covariance += sum((x - mean_x) * (y - mean_y) for x, y in points)
        variance += sum((x - mean_x) ** 2 for x, _ in points)
    if variance <= 0:
        raise ValueError("a shared slope needs a group with two distinct x values")
    return covariance / variance


def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """ys at x, piecewise-linear between the points (xs strictly increasing), the end segments
    extended past the ends; a single point is a constant."""
    if not xs or len(xs) != len(ys):
        raise ValueError("interp needs as many y values as x values, at least one")
    if len(xs) == 1:
        return float(ys[0])
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def attention_tokens(start: int, num_new: int) -> int:
    """A of `num_new` new tokens at positions start .. start + num_new - 1: each attends its own
    position and every one before it, so A = sum of (position + 1)."""
    return num_new * start + num_new * (num_new + 1) // 2


@dataclass(frozen=True)
class StepModel:
    """The step formula over measured points: seconds[threads][i] at tokens[i], attn[threads]."""

    tokens: Sequence[int]
    seconds: Mapping[int, Sequence[float]]
    attn: Mapping[int, float]

    def step_s(self, threads: int, num_tokens: float, attn_tokens: float) -> float:
        if threads not in self.seconds:
            raise ValueError(f"no steps were measured at {threads} threads: {sorted(self.seconds)}")
        base = interp(self.tokens, self.seconds[threads], num_tokens)
        return base + self.attn[threads] * attn_tokens
