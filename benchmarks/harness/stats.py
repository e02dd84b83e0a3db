"""The one percentile the benchmarks report: linear between the two nearest ranks (numpy's default, and
`statistics.quantiles(..., method="inclusive")`), so p50 is the median and p100 the maximum."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q` quantile (0 ≤ q ≤ 1) of `values`; None when there are none."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"a quantile is between 0 and 1, not {q}")
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None
