"""The bench's intervals, verdicts and references on cases with a known answer."""

from __future__ import annotations

import random

import pytest

from adaptive_spec.bench import compare, stats
from adaptive_spec.bench.compare import BEST_SEEN, BEST_STATIC
from tests.support.bench_records import two_statics_and_adaptive


def _speeds(n: int, seed: int, scale: float = 1.0) -> list[tuple[float, float]]:
    """(tokens, ms) units whose speeds vary from request to request around 50 tok/s × scale."""
    rng = random.Random(seed)
    return [(160.0, 160.0 / (50.0 * scale * rng.uniform(0.8, 1.2)) * 1000) for _ in range(n)]


def test_identical_samples_give_an_interval_of_exactly_one() -> None:
    units = _speeds(20, seed=1)
    found = stats.paired_ratio(list(zip(units, units, strict=True)), stats.throughput)
    assert found is not None
    assert (found.value, found.low, found.high, found.units) == (1.0, 1.0, 1.0, 20)
    assert found.spans_one and stats.verdict(found, "faster", "slower") == "indistinguishable"


def test_a_clear_twofold_difference_excludes_one() -> None:
    slow, fast = _speeds(20, seed=2), _speeds(20, seed=3, scale=2.0)
    found = stats.paired_ratio(list(zip(fast, slow, strict=True)), stats.throughput)
    assert found is not None
    assert found.low > 1.5 and found.low <= found.value <= found.high < 2.6
    assert stats.verdict(found, "faster", "slower") == "faster"
    backwards = stats.paired_ratio(list(zip(slow, fast, strict=True)), stats.throughput)
    assert backwards is not None and stats.verdict(backwards, "faster", "slower") == "slower"


def test_noise_without_a_difference_is_indistinguishable() -> None:
    a, b = _speeds(12, seed=4), _speeds(12, seed=5)
    found = stats.paired_ratio(list(zip(a, b, strict=True)), stats.throughput)
    assert found is not None and found.spans_one and found.low < 1.0 < found.high


def test_the_bootstrap_is_seeded_and_handles_empty_input() -> None:
    units = list(zip(_speeds(10, seed=6), _speeds(10, seed=7), strict=True))
    assert stats.paired_ratio(units, stats.throughput, seed=3) == stats.paired_ratio(units, stats.throughput, seed=3)
    assert stats.paired_ratio([], stats.throughput) is None
    assert stats.paired_ratio([((0.0, 0.0), (1.0, 1.0))], stats.throughput) is None
    assert stats.bootstrap([], stats.median) is None
    same = stats.bootstrap([7.0] * 5, stats.median)
    assert same is not None and (same.value, same.low, same.high) == (7.0, 7.0, 7.0)


def test_verdicts_name_a_real_difference_and_an_absent_one() -> None:
    records = compare.with_references(two_statics_and_adaptive(adaptive_speed=80), ["oneshot", "iterative"])
    by = {c.against: c for c in compare.comparisons(records, ["oneshot", "iterative"])}
    assert list(by) == ["oneshot", "iterative", BEST_STATIC, BEST_SEEN]
    assert compare.describe(by["oneshot"]).startswith("adaptive vs oneshot: decode tok/s 2.000× [")
    assert "faster" in compare.describe(by["oneshot"]) and "later second token" in compare.describe(by["oneshot"])
    same = by["iterative"]
    assert same.speed is not None and same.speed.value == pytest.approx(1.0)
    assert "decode tok/s 1.000× [1.000, 1.000] indistinguishable" in compare.describe(same)
    assert "sooner second token" in compare.describe(same)
    assert "(not an upper bound)" in compare.describe(by[BEST_STATIC])


def test_the_best_seen_reference_bounds_the_adaptive_pass_and_best_static_need_not() -> None:
    # The adaptive pass beats both statics (e.g. each server kept its own sessions' cache): the best static per
    # request is then below it, while the best seen per request, the adaptive pass included, still bounds it.
    records = compare.with_references(two_statics_and_adaptive(adaptive_speed=100), ["oneshot", "iterative"])
    by = {c.against: c for c in compare.comparisons(records, ["oneshot", "iterative"])}
    static, seen = by[BEST_STATIC], by[BEST_SEEN]
    assert static.speed is not None and static.speed.value == pytest.approx(1.25)
    assert seen.speed is not None and seen.speed.value == pytest.approx(1.0) and seen.speed.high <= 1.0 + 1e-9
    assert seen.ttst is not None and seen.ttst.value >= 1.0  # TTST: the bound is the shortest, so adaptive >= it
    assert {r["served_profile"] for r in records if r["profile"] == BEST_STATIC} == {"iterative"}


def test_target_intervals_pair_each_target_with_the_baseline() -> None:
    found = {t.name: t for t in compare.target_intervals(two_statics_and_adaptive(adaptive_speed=80), "oneshot")}
    assert set(found) == {"oneshot", "iterative", "adaptive"}
    iterative = found["iterative"]
    assert iterative.vs_baseline is not None and iterative.vs_baseline.value == pytest.approx(2.0)
    assert iterative.output_from_drafts is not None and iterative.output_from_drafts.value == pytest.approx(0.5)
    assert iterative.decode_tok_s is not None and iterative.decode_tok_s.low < iterative.decode_tok_s.high
    assert found["oneshot"].vs_baseline is not None and found["oneshot"].vs_baseline.high == pytest.approx(1.0)
    assert compare.target_intervals(two_statics_and_adaptive(adaptive_speed=80), None)[0].vs_baseline is None
