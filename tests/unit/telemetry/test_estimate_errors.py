"""A route's time estimates against llama-server's timings: what a record keeps (`Decision.time_estimate`) and the
median and worst errors `/adaptive/requests` and `adaptive-spec report` show (`telemetry/estimate_errors.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from adaptive_spec.kv.costs import PrefillRate
from adaptive_spec.routing.decision import Choice, Decision, MovePart, PromptPart, compose
from adaptive_spec.routing.estimate import Estimate
from adaptive_spec.telemetry import estimate_errors
from adaptive_spec.telemetry.records import Timings

RATE = PrefillRate(0.01, 0.002)


def _decision(new_tokens: int = 2000, context: int = 6000, basis: str = "measured") -> Decision:
    estimate = Estimate(
        profile="plain",
        prefill_tokens=new_tokens,
        prefill_s=RATE.seconds(new_tokens, context - new_tokens),
        handoff_s=0.0,
        output_tokens=100,
        decode_tps=20.0,
        speedup=1.0,
        total_s=0.0,
        basis="measured" if basis == "measured" else "prior",
        prefill_rate=RATE,
    )
    choice = Choice("plain", "estimate", ("r",), 0.0, context, estimates=(estimate,))
    return compose(choice, PromptPart(new_tokens=new_tokens))


def test_a_record_keeps_the_estimates_beside_what_llama_server_measured() -> None:
    timings = Timings(prompt_n=2000, cache_n=4000, predicted_n=50, prompt_ms=40_000.0, predicted_ms=2_000.0)
    estimate = _decision().time_estimate(timings)
    assert estimate is not None
    as_json = estimate.to_json()
    assert as_json["basis"] == "measured"
    assert (
        as_json["prefill_s_est"] == pytest.approx(RATE.seconds(2000, 4000), abs=1e-3) and as_json["prefill_s"] == 40.0
    )
    assert as_json["decode_s_est"] == pytest.approx(2.5) and as_json["decode_s"] == 2.0  # 50 tokens at 20 tok/s
    assert as_json["decode_error"] == pytest.approx(0.25)
    assert as_json["prefill_error"] == pytest.approx(RATE.seconds(2000, 4000) / 40.0 - 1, abs=1e-3)


def test_a_warm_start_prices_only_what_it_left_to_prefill() -> None:
    warm = _decision().after(MovePart("warm: head of 1,500 tokens restored", new_tokens=500))
    estimate = warm.time_estimate(Timings(prompt_n=500, cache_n=5500, prompt_ms=9_000.0))
    assert estimate is not None and estimate.prefill_s_est == pytest.approx(RATE.seconds(500, 5500))


def test_no_estimate_without_one_to_judge() -> None:
    pinned = compose(Choice("plain", "pinned", ("pinned",), 0.0, 100))
    assert pinned.time_estimate(Timings(prompt_n=10, prompt_ms=5.0)) is None
    assert _decision().time_estimate(None) is None
    assert _decision().time_estimate(Timings(prompt_n=10, from_usage=True)) is None


def _record(basis: str, prefill: tuple[float, float], decode: tuple[float, float], own: str | None = None) -> Any:
    est = {
        "basis": basis,
        "prefill_s_est": prefill[0],
        "prefill_s": prefill[1],
        "prefill_error": prefill[0] / prefill[1] - 1,
        "decode_s_est": decode[0],
        "decode_s": decode[1],
        "decode_error": decode[0] / decode[1] - 1,
    }
    return {"time_estimate": est, "own": own}


def test_the_summary_gives_median_and_worst_error_by_basis() -> None:
    records = [
        _record("prior", (45.0, 300.0), (10.0, 12.0)),  # issue 53: 17,938 tokens "≈ 44.84 s" took over 300 s
        _record("prior", (3.75, 5.0), (10.0, 10.0)),
        _record("measured", (290.0, 300.0), (11.0, 12.0)),
        _record("measured", (5.5, 5.0), (10.0, 10.0)),
        _record("measured", (0.01, 0.05), (1.0, 1.0)),  # too short a prefill to judge: left out of prefill
        {"time_estimate": None},
        _record("measured", (1.0, 100.0), (1.0, 100.0), own="speed measurement"),  # the proxy's own: not judged
    ]
    summary = estimate_errors.summarize(records)
    assert summary["prior"]["prefill"] == {"n": 2, "median_error": pytest.approx(0.55), "worst_error": -0.85}
    assert summary["measured"]["prefill"]["n"] == 2 and summary["measured"]["decode"]["n"] == 3
    assert summary["measured"]["prefill"]["worst_error"] == pytest.approx(0.1)
    table = estimate_errors.to_markdown(summary)
    assert "| prefill | prior | 2 | 55% | -85% |" in table, table


def test_the_report_of_a_trace_shows_the_errors(tmp_path: Path) -> None:
    from adaptive_spec.bench.trace_report import run_report

    base = {"kind": "request", "profile": "plain", "outcome": "finished", "status": 200, "stream": False}
    timings = {"prompt_n": 2000, "cache_n": 0, "predicted_n": 100, "prompt_ms": 30_000.0, "predicted_ms": 5_000.0}
    lines = [{**base, "timings": timings, **_record("prior", (45.0, 300.0), (10.0, 12.0))}]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(orjson.dumps(line).decode() for line in lines) + "\n")
    assert "| prefill | prior | 1 | 85% | -85% |" in run_report([trace], None, None)
