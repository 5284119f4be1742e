"""Step times taken beside plain PyTorch steps: one pair protocol and its statistics (issue 28).

This VM's speed drifts by 10-30 % within minutes and a step's time correlates with the next
one's, so a schedule's time is read as its ratio to a plain step run right before it, and the
ratio's median is what a prediction is checked against. The timing in context
(:mod:`xengine.profile.context`) and the benchmarks (``experiments/time_fidelity.py``,
``experiments/keep_all_overhead.py``) take their pairs the same way, a plain step first and
then one step of the schedule, so that the schedule's step always follows a plain step: a
step's time depends on the one before it (the allocator's free lists, the caches), and two
orders would be two protocols.

The noise of a median is stated with it: half the interquartile range over the median
(:func:`noise`), and the standard error of the median from it (:func:`median_se`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence


def pairs(
    plain_step: Callable[[], float],
    step: Callable[[], float],
    warmup: int,
    rounds: int,
    min_s: float,
    most: int,
) -> tuple[list[float], list[float]]:
    """``warmup`` pairs of ``plain_step()`` then ``step()`` (each returns its seconds), then
    at least ``rounds`` pairs and at least ``min_s`` seconds of them, ``most`` at most. The
    step times in seconds: the schedule's, and the plain steps' beside them."""
    for _ in range(warmup):
        plain_step()
        step()
    mine: list[float] = []
    beside: list[float] = []
    spent = 0.0
    while len(mine) < most and (len(mine) < rounds or spent < min_s):
        dt_plain = plain_step()
        dt = step()
        mine.append(dt)
        beside.append(dt_plain)
        spent += dt + dt_plain
    return mine, beside


def ratios(mine: Sequence[float], beside: Sequence[float]) -> list[float]:
    """Each step's time over the plain step's beside it."""
    return [a / b for a, b in zip(mine, beside, strict=True)]


def noise(xs: Sequence[float]) -> float:
    """Half the interquartile range over the median (relative)."""
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return (q3 - q1) / 2 / statistics.median(xs)


def median_se(xs: Sequence[float]) -> float:
    """The standard error of the median of ``xs``, relative: 1.253 sigma / sqrt(n), sigma
    estimated robustly as IQR / 1.349 (normal approximation); NaN for fewer than 4."""
    if len(xs) < 4:
        return float("nan")
    return 1.253 * 2 * noise(xs) / 1.349 / math.sqrt(len(xs))


__all__ = ["median_se", "noise", "pairs", "ratios"]
