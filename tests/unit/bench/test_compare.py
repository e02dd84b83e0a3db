"""The bench's bar for the adaptive route: the one static setting that decoded a workload fastest."""

from __future__ import annotations

from typing import Any

from adaptive_spec.bench.compare import ADAPTIVE, best_static, describe_best


def _record(profile: str, index: int, ms: float) -> dict[str, Any]:
    timings = {"predicted_n": 100, "predicted_ms": ms, "draft_n_accepted": 0}
    return {"profile": profile, "index": index, "round": 0, "outcome": "finished", "timings": timings, "ttst_ms": 5.0}


def test_the_best_static_setting_is_the_fastest_over_the_requests_all_finished() -> None:
    records = [
        *(_record("plain", i, 1000.0) for i in range(4)),
        *(_record("oneshot", i, 2000.0) for i in range(4)),
        # ngram is fastest on the requests it finished, but one is missing: only the shared ones count.
        *(_record("ngram", i, 900.0 if i < 3 else 100.0) for i in range(4)),
        _record("iterative", 0, 10.0),
    ]
    assert best_static(records, ["plain", "oneshot", "ngram"]) == "ngram"
    assert best_static(records, ["plain", "oneshot"]) == "plain"
    assert best_static(records, ["plain", "iterative"]) == "iterative"  # request 0 is the only one both finished
    assert describe_best(records, ["plain", "oneshot"]) is None  # no adaptive pass: nothing to compare
    records += [_record(ADAPTIVE, i, 1000.0) for i in range(4)]
    line = describe_best(records, ["plain", "oneshot"])
    assert line is not None and line.startswith("best static setting for this workload: plain; adaptive vs it: ")
    assert "decode tok/s 1.000× [1.000, 1.000] indistinguishable" in line, line


def test_a_pass_restarts_each_server_once() -> None:
    from adaptive_spec.bench.runner import one_per_server

    profiles: list[dict[str, Any]] = [
        {"name": "oneshot", "base_url": "http://a", "preset": None},
        {"name": "iterative", "base_url": "http://a", "preset": None},  # a setting of the same server
        {"name": "plain", "base_url": "http://r", "preset": "plain"},  # router mode: each preset its own child
        {"name": "ngram", "base_url": "http://r", "preset": "ngram"},
    ]
    assert one_per_server(profiles) == ["oneshot", "plain", "ngram"]
