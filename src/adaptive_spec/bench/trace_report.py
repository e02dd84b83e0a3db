"""`adaptive-spec report TRACE`: read a trace, print the table, write CSV, Markdown and a PNG chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from adaptive_spec.bench.table import ReportRow, baseline_profile, summarize, to_csv, to_markdown
from adaptive_spec.errors import ConfigError
from adaptive_spec.telemetry import estimate_errors


def read_trace(paths: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(request records, profiles) from one or more trace files (rotated parts included), oldest line first."""
    records: list[dict[str, Any]] = []
    profiles: list[dict[str, Any]] = []
    for path in paths:
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read trace {path}: {exc.strerror or exc}") from exc
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{number}: not a JSON line ({exc})") from exc
            if item.get("kind") == "request":
                records.append(item)
            elif item.get("kind") == "profiles":
                profiles = item.get("profiles") or profiles
    return records, profiles


def chart(rows: list[ReportRow], path: Path) -> None:
    """Grouped bars per profile: decode tok/s, and median time to second token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in rows]
    xs = range(len(rows))
    fig, (speed_ax, ttst_ax) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    speed_ax.bar([x - 0.2 for x in xs], [r.decode_tok_s for r in rows], 0.4, color="#4c72b0", label="aggregate")
    speed_ax.bar(
        [x + 0.2 for x in xs], [r.decode_tok_s_median for r in rows], 0.4, color="#dd8452", label="median request"
    )
    speed_ax.set_title("decode speed (tok/s)")
    speed_ax.legend()
    ttst_ax.bar(list(xs), [r.ttst_ms_median or 0.0 for r in rows], 0.5, color="#55a868")
    ttst_ax.set_title("time to second token, median (ms)")
    for ax in (speed_ax, ttst_ax):
        ax.set_xticks(list(xs), names, rotation=15)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_report(paths: list[Path], out_dir: Path | None, baseline: str | None) -> str:
    records, profiles = read_trace(paths)
    if not records:
        raise ConfigError(f"no request records in {', '.join(map(str, paths))}")
    baseline = baseline or baseline_profile(profiles)
    rows = summarize(records, baseline)
    table = to_markdown(rows, baseline)
    errors = estimate_errors.summarize(records)
    if errors:  # traces from before the records kept their estimates have none
        table += "\n\n" + estimate_errors.to_markdown(errors)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "report.csv").write_text(to_csv(rows))
        (out_dir / "report.md").write_text(table + "\n")
        chart(rows, out_dir / "report.png")
    return table
