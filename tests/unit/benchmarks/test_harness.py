"""The benchmarks' harness: one percentile, and a result file that says what its figures were measured on."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from benchmarks.harness import results
from benchmarks.harness.stats import percentile


def test_the_percentile_is_linear_between_ranks_like_numpys_default() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 0.5) == statistics.median(values) == 3.0
    assert percentile(values, 0.0) == 1.0 and percentile(values, 1.0) == 5.0
    assert percentile(values, 0.9) == pytest.approx(4.6)  # 0.9 × 4 = 3.6: 60% of the way from 4 to 5
    assert percentile([1.0, 2.0], 0.95) == pytest.approx(1.95)
    inclusive = statistics.quantiles(values, n=10, method="inclusive")
    assert percentile(values, 0.1) == pytest.approx(inclusive[0])
    assert percentile([], 0.5) is None
    with pytest.raises(ValueError, match="between 0 and 1"):
        percentile(values, 95)


def test_a_result_file_holds_the_figures_and_what_they_were_measured_on(tmp_path: Path) -> None:
    out = results.write(tmp_path / "deep" / "r.json", "benchmarks.x.y", {"p50_ms": 1.5, "rows": [1, 2]})
    document = json.loads(out.read_text())
    assert document["benchmark"] == "benchmarks.x.y"
    assert document["figures"] == {"p50_ms": 1.5, "rows": [1, 2]}
    run = document["run"]
    assert run["commit"] is None or len(run["commit"]) == 40
    assert run["machine"]["cores"] >= 1 and run["machine"]["python"].count(".") == 2
    assert run["load_at_end"]["cores"] >= 1  # sampled when the file was written
    assert isinstance(run["command"], list)
    assert results.read(out) == {"p50_ms": 1.5, "rows": [1, 2]}


def test_a_result_file_from_before_the_harness_reads_as_its_own_figures(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"runs": {"before": {"p50_ms": 2.0}}}))
    assert results.read(old) == {"runs": {"before": {"p50_ms": 2.0}}}
    old.write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds an object"):
        results.read(old)
