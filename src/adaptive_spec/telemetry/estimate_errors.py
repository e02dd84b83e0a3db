"""How far the routes' time estimates were from llama-server's own timings over a set of records: the median and
worst error of the prefill and decode estimates, apart for estimates on the policy's priors and on measured speeds.

Pure: it reads records as their JSON (`RequestRecord.to_json`: the history's, a trace's lines), so `/adaptive/requests`
and `adaptive-spec report` show the same figures.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any

# Prefills shorter than this time fixed costs, not speed: a 3-token prompt's 40 ms against 30 ms estimated is not a
# 33% error a reader should see.
MIN_MEASURED_S = 0.2


def summarize(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, float | int]]]:
    """{basis: {"prefill"|"decode": {"n", "median_error", "worst_error"}}}: errors as estimated over measured, less
    1 (the median of their sizes, and the largest with its sign); a part with no estimate to judge is left out."""
    errors: dict[str, dict[str, list[float]]] = {}
    for record in records:
        estimate = record.get("time_estimate")
        if not isinstance(estimate, Mapping) or record.get("own"):
            continue
        basis = str(estimate.get("basis") or "prior")
        for part in ("prefill", "decode"):
            error, measured = estimate.get(f"{part}_error"), estimate.get(f"{part}_s")
            if isinstance(error, int | float) and isinstance(measured, int | float) and measured >= MIN_MEASURED_S:
                errors.setdefault(basis, {}).setdefault(part, []).append(float(error))
    return {
        basis: {
            part: {
                "n": len(values),
                "median_error": round(statistics.median(abs(v) for v in values), 4),
                "worst_error": max(values, key=abs),
            }
            for part, values in parts.items()
        }
        for basis, parts in sorted(errors.items())
    }


def to_markdown(summary: Mapping[str, Mapping[str, Mapping[str, float | int]]]) -> str:
    """The summary as a table: one row per basis and part."""
    lines = [
        "| time estimate | basis | requests | median error | worst error |",
        "|---|---|---:|---:|---:|",
    ]
    for basis, parts in summary.items():
        for part, figures in parts.items():
            lines.append(
                f"| {part} | {basis} | {figures['n']} | {figures['median_error']:.0%} | {figures['worst_error']:+.0%} |"
            )
    return "\n".join(lines)
