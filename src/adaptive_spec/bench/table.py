"""The seed-style table from request records: per profile, and for everything as it was routed."""

from __future__ import annotations

import csv
import io
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from adaptive_spec.bench.stats import Interval

ALL_ROUTED = "all (as routed)"


@dataclass(frozen=True, slots=True)
class ReportRow:
    name: str
    requests: int
    output_tokens: int
    decode_tok_s: float  # aggregate: Σ predicted_n / Σ decode time
    decode_tok_s_median: float  # median of per-request decode speeds
    ratio_to_baseline: float | None
    acceptance: float | None  # accepted / drafted
    output_from_drafts: float  # accepted / output tokens
    ttft_ms_median: float | None
    ttst_ms_median: float | None
    session_moves: int  # moves of a session onto this profile (all: every move)
    wall_s: float  # Σ request durations as the client saw them


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def moves_into(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """How many times a session's next request went to another profile than its previous one, counted on the
    profile it moved to (so the profiles' counts add up to the total)."""
    last: dict[str, str] = {}
    moves: dict[str, int] = {}
    for record in sorted(records, key=lambda r: float(r.get("started_at_unix", 0.0))):
        session = record.get("session_id")
        if not session:
            continue
        profile = str(record.get("served_profile") or record.get("profile"))
        if session in last and last[session] != profile:
            moves[profile] = moves.get(profile, 0) + 1
        last[session] = profile
    return moves


def session_moves(records: Iterable[Mapping[str, Any]]) -> int:
    """How many times a session's next request went to another profile than its previous one."""
    return sum(moves_into(records).values())


def _row(name: str, records: list[Mapping[str, Any]], baseline_speed: float | None, moves: int) -> ReportRow:
    timings = [r["timings"] for r in records if isinstance(r.get("timings"), dict)]
    predicted = sum(int(t.get("predicted_n", 0)) for t in timings)
    decode_ms = sum(float(t.get("predicted_ms", 0.0)) for t in timings)
    drafted = sum(int(t.get("draft_n", 0)) for t in timings)
    accepted = sum(int(t.get("draft_n_accepted", 0)) for t in timings)
    speed = predicted / (decode_ms / 1000.0) if decode_ms > 0 else 0.0
    per_request = [float(t["predicted_per_second"]) for t in timings if float(t.get("predicted_per_second", 0)) > 0]
    return ReportRow(
        name=name,
        requests=len(records),
        output_tokens=predicted,
        decode_tok_s=speed,
        decode_tok_s_median=_median(per_request) or 0.0,
        ratio_to_baseline=speed / baseline_speed if baseline_speed else None,
        acceptance=accepted / drafted if drafted else None,
        output_from_drafts=accepted / predicted if predicted else 0.0,
        ttft_ms_median=_median([float(r["ttft_ms"]) for r in records if r.get("ttft_ms") is not None]),
        ttst_ms_median=_median([float(r["ttst_ms"]) for r in records if r.get("ttst_ms") is not None]),
        session_moves=moves,
        wall_s=sum(float(r.get("total_ms") or 0.0) for r in records) / 1000.0,
    )


def summarize(records: Iterable[Mapping[str, Any]], baseline: str | None = None) -> list[ReportRow]:
    """One row per profile (in order of first use) and one for all requests as routed. Only finished
    generating requests count; `baseline` names the profile the ratios are taken against."""
    finished = [r for r in records if r.get("outcome") == "finished" and r.get("timings")]
    by_profile: dict[str, list[Mapping[str, Any]]] = {}
    for record in finished:
        by_profile.setdefault(str(record.get("profile")), []).append(record)
    moves = moves_into(finished)  # a move is seen across profiles: counted on the one moved to
    base_rows = by_profile.get(baseline) if baseline is not None else None
    baseline_speed = _row(baseline, base_rows, None, 0).decode_tok_s if baseline and base_rows else None
    rows = [_row(name, recs, baseline_speed, moves.get(name, 0)) for name, recs in by_profile.items()]
    if finished:
        rows.append(_row(ALL_ROUTED, finished, baseline_speed, sum(moves.values())))
    return rows


def _fmt(value: Any, pct: bool = False) -> str:
    if value is None:
        return "—"
    if pct:
        return f"{value:.0%}"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def to_markdown(rows: list[ReportRow], baseline: str | None, vs_baseline: Mapping[str, Interval] | None = None) -> str:
    """The table; `vs_baseline` (the bench's) gives the baseline column's 95% intervals."""
    head = (
        "| profile | requests | output tokens | decode tok/s | median tok/s | vs "
        + (baseline or "baseline")
        + " | acceptance | output from drafts | TTFT p50 (ms) | TTST p50 (ms) | moves | wall (s) |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        cells = [
            r.name,
            _fmt(r.requests),
            _fmt(r.output_tokens),
            _fmt(r.decode_tok_s),
            _fmt(r.decode_tok_s_median),
            _vs_baseline(r, (vs_baseline or {}).get(r.name)),
            _fmt(r.acceptance, pct=True),
            _fmt(r.output_from_drafts, pct=True),
            _fmt(r.ttft_ms_median),
            _fmt(r.ttst_ms_median),
            _fmt(r.session_moves),
            _fmt(r.wall_s),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _vs_baseline(row: ReportRow, interval: Interval | None) -> str:
    if row.ratio_to_baseline is None:
        return "—"
    if interval is None:
        return f"{row.ratio_to_baseline:.2f}"
    return f"{row.ratio_to_baseline:.2f} [{interval.low:.2f}, {interval.high:.2f}]"


def to_csv(rows: list[ReportRow]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=[f.name for f in fields(ReportRow)])
    writer.writeheader()
    for row in rows:
        writer.writerow(asdict(row))
    return out.getvalue()


def baseline_profile(profiles: Iterable[Mapping[str, Any]]) -> str | None:
    """The profile without speculation, when the trace's profile list shows one."""
    for profile in profiles:
        if profile.get("spec_types") in (["none"], ("none",)):
            return str(profile["name"])
    return None
