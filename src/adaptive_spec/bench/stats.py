"""95% intervals for the bench's ratios: a paired, seeded percentile bootstrap over requests and repeats.

Each unit is one request of one round (repeat), seen by both targets being compared: resampling units with
replacement keeps the pairing (a hard request is hard for both targets, so its cost cancels in the ratio) and spreads
the machine's slow spells, which fall on whole rounds, over the resamples. The interval says how far the ratio moves
when the same experiment is drawn again from the requests and rounds that were run; a ratio whose interval spans 1
is not a difference this run can show. Pure: no I/O, the same answer for the same input and seed.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

RESAMPLES = 2000
LEVEL = 0.95


@dataclass(frozen=True, slots=True)
class Interval:
    """A statistic (or a ratio `a / b`) with its bootstrap interval; `units` is how many units it rests on."""

    value: float
    low: float
    high: float
    units: int

    @property
    def spans_one(self) -> bool:
        return self.low <= 1.0 <= self.high

    def text(self) -> str:
        return f"{self.value:.3f}× [{self.low:.3f}, {self.high:.3f}]"


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _percentiles(draws: list[float], point: float, units: int, level: float) -> Interval | None:
    if not draws:
        return None
    draws.sort()
    tail = (1.0 - level) / 2
    return Interval(point, _quantile(draws, tail), _quantile(draws, 1.0 - tail), units)


def paired_ratio(
    pairs: Sequence[tuple[T, T]],
    stat: Callable[[Sequence[T]], float],
    resamples: int = RESAMPLES,
    seed: int = 0,
    level: float = LEVEL,
) -> Interval | None:
    """stat(a) / stat(b) over paired units, with a percentile bootstrap interval; None without pairs or where a
    statistic is not positive (nothing to divide by)."""
    if not pairs:
        return None
    a_all, b_all = [p[0] for p in pairs], [p[1] for p in pairs]
    a_stat, b_stat = stat(a_all), stat(b_all)
    if not (a_stat > 0 and b_stat > 0):
        return None
    rng = random.Random(seed)
    n = len(pairs)
    ratios: list[float] = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        a, b = stat([a_all[i] for i in picks]), stat([b_all[i] for i in picks])
        if a > 0 and b > 0:
            ratios.append(a / b)
    return _percentiles(ratios, a_stat / b_stat, n, level)


def bootstrap(
    units: Sequence[T],
    stat: Callable[[Sequence[T]], float],
    resamples: int = RESAMPLES,
    seed: int = 0,
    level: float = LEVEL,
) -> Interval | None:
    """stat(units) with a percentile bootstrap interval (the chart's error bars); None without units."""
    if not units:
        return None
    rng = random.Random(seed)
    n = len(units)
    draws = [stat([units[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples)]
    return _percentiles(draws, stat(units), n, level)


# The statistics the bench compares. A unit's throughput is (output tokens, decode ms); TTST is milliseconds.


def throughput(units: Sequence[tuple[float, float]]) -> float:
    """Aggregate decode speed, Σ tokens / Σ time, as the bench's table reports it (tokens per second)."""
    ms = sum(u[1] for u in units)
    return sum(u[0] for u in units) / (ms / 1000.0) if ms > 0 else 0.0


def median(units: Sequence[float]) -> float:
    return statistics.median(units) if units else 0.0


def verdict(interval: Interval, higher: str, lower: str) -> str:
    """`higher` or `lower` when the interval sits on one side of 1, else "indistinguishable"."""
    if interval.spans_one:
        return "indistinguishable"
    return higher if interval.low > 1.0 else lower
