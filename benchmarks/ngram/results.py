"""The results of `ngram_params.py`: one request's measurements, one config's run, and the summary table."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TurnResult:
    workload: str
    index: int
    ttft_ms: float
    ttst_ms: float | None
    wall_ms: float
    content: str
    finish_reason: str | None
    prompt_n: int
    cache_n: int
    predicted_n: int
    predicted_ms: float
    draft_n: int
    draft_n_accepted: int
    matches_reference: bool | None = None


@dataclass
class ConfigRun:
    config: str
    spec_args: list[str]
    iterative: list[TurnResult] = field(default_factory=list)
    oneshot: list[TurnResult] = field(default_factory=list)


def rate(results: list[TurnResult]) -> float:
    ms = sum(r.predicted_ms for r in results)
    return 1000 * sum(r.predicted_n for r in results) / ms if ms > 0 else float("nan")


def summarise(runs: list[ConfigRun], baseline: str) -> list[dict[str, Any]]:
    """One row per config, ratios against the `baseline` config's run."""
    plain = next(r for r in runs if r.config == baseline)
    plain_iter, plain_one = rate(plain.iterative), rate(plain.oneshot)
    rows: list[dict[str, Any]] = []
    for run in runs:
        drafted = sum(r.draft_n for r in run.iterative)
        accepted = sum(r.draft_n_accepted for r in run.iterative)
        predicted = sum(r.predicted_n for r in run.iterative)
        one_drafted = sum(r.draft_n for r in run.oneshot)
        one_accepted = sum(r.draft_n_accepted for r in run.oneshot)
        gaps = [r.ttst_ms - r.ttft_ms for r in run.oneshot if r.ttst_ms is not None]
        it_rate, one_rate = rate(run.iterative), rate(run.oneshot)
        rows.append(
            {
                "config": run.config,
                "iter_tok_s": it_rate,
                "iter_ratio": it_rate / plain_iter,
                "iter_acceptance": accepted / drafted if drafted else None,
                "iter_accepted_share": accepted / predicted if predicted else None,
                "iter_predicted_n": predicted,
                "iter_same_as_plain": sum(1 for r in run.iterative if r.matches_reference),
                "oneshot_tok_s": one_rate,
                "oneshot_ratio": one_rate / plain_one,
                "oneshot_acceptance": one_accepted / one_drafted if one_drafted else None,
                "oneshot_median_ttst_minus_ttft_ms": statistics.median(gaps) if gaps else None,
                "oneshot_median_ttft_ms": statistics.median(r.ttft_ms for r in run.oneshot),
            }
        )
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown(rows: list[dict[str, Any]], turns: int) -> str:
    lines = [
        "| config | iter tok/s | iter vs plain | acceptance | accepted share | same as plain | "
        "one-shot tok/s | one-shot vs plain | median TTST-TTFT (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['iter_tok_s']:.1f} | {r['iter_ratio']:.2f} | "
            f"{_fmt(r['iter_acceptance'], '.0%')} | {_fmt(r['iter_accepted_share'], '.0%')} | "
            f"{r['iter_same_as_plain']}/{turns} | {r['oneshot_tok_s']:.1f} | {r['oneshot_ratio']:.2f} | "
            f"{_fmt(r['oneshot_median_ttst_minus_ttft_ms'], '.1f')} |"
        )
    return "\n".join(lines)
