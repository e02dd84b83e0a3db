"""bench.png: decode tok/s, median TTST and output from drafts side by side, one group of bars per workload and one bar
per target, the 95% intervals as error bars, and × the baseline profile above the speed bars where there is one.

The legend sits below the panels, outside every axis, so it never covers a bar."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PANELS = (
    ("decode_tok_s", "decode tok/s (aggregate)", 1.0),
    ("ttst_ms_median", "time to 2nd token, p50 (ms)", 1.0),
    ("output_from_drafts", "output from drafts (%)", 100.0),
)


def _find(rows: Sequence[Mapping[str, Any]], workload: str, name: str) -> Mapping[str, Any] | None:
    return next((r for r in rows if r["workload"] == workload and r["name"] == name), None)


def _errors(value: float, interval: Mapping[str, Any] | None, scale: float) -> tuple[float, float]:
    """matplotlib's yerr (below, above) for one bar; no bar where there is no interval."""
    if not interval:
        return 0.0, 0.0
    return max(0.0, value - interval["low"] * scale), max(0.0, interval["high"] * scale - value)


def chart(
    rows: Sequence[Mapping[str, Any]],
    intervals: Sequence[Mapping[str, Any]],
    baseline: str | None,
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    targets = list(dict.fromkeys(r["name"] for r in rows))
    width = 0.8 / max(1, len(targets))
    fig, axes = plt.subplots(
        1, len(PANELS), figsize=(max(12, 4.5 * len(workloads) * 1.0 + 6), 4.6), layout="constrained", squeeze=False
    )
    for ax, (key, label, scale) in zip(axes[0], PANELS, strict=True):
        for i, target in enumerate(targets):
            xs, values, below, above = [], [], [], []
            for w, workload in enumerate(workloads):
                row, found = _find(rows, workload, target), _find(intervals, workload, target)
                value = float(row[key] or 0.0) * scale if row and row.get(key) is not None else 0.0
                low, high = _errors(value, found.get(key) if found else None, scale)
                xs.append(w + (i - (len(targets) - 1) / 2) * width)
                values.append(value)
                below.append(low)
                above.append(high)
                if key == "decode_tok_s" and baseline and found and found.get("vs_baseline") and target != baseline:
                    ax.annotate(
                        f"{found['vs_baseline']['value']:.2f}×",
                        (xs[-1], value + high),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        xytext=(0, 2),
                        textcoords="offset points",
                    )
            color = f"C{i}"
            ax.bar(xs, values, width, yerr=[below, above], capsize=3, label=target, color=color, ecolor="0.25")
        ax.set_xticks(list(range(len(workloads))), workloads)
        ax.set_ylabel(label)
        ax.margins(y=0.12)
    title = "95% intervals as error bars"
    if baseline:
        title += f"; × {baseline} above the speed bars"
    fig.suptitle(title, fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(targets), 5), frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)
