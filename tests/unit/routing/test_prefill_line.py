"""The prefill line: a prompt token at position p costs a + b·p; fitted from llama-server's (cache_n, prompt_n,
prompt_ms), its slope's prior a share of its intercept, and what the speed model makes of it (measured at start, kept
across runs, said in the reason)."""

from __future__ import annotations

import pytest

from adaptive_spec.kv.costs import PrefillRate
from adaptive_spec.policy.model import EstimatorPolicy, HandoffPolicy
from adaptive_spec.routing.prefill_line import PrefillLine
from adaptive_spec.routing.speeds import SpeedModel
from adaptive_spec.telemetry.records import Timings

# The 0.5B on this CPU, roughly: 10 ms a token at the start, 3 ms more per 1,000 tokens before it.
TRUE = PrefillRate(0.010, 0.003)


def _timings(cached: int, new: int, rate: PrefillRate = TRUE, predicted_n: int = 0, decode_s: float = 0.0) -> Timings:
    return Timings(
        prompt_n=new,
        cache_n=cached,
        prompt_ms=rate.seconds(new, cached) * 1000.0,
        predicted_n=predicted_n,
        predicted_ms=predicted_n * decode_s * 1000.0,
    )


def _model(**estimator: float) -> SpeedModel:
    return SpeedModel(EstimatorPolicy(**estimator), HandoffPolicy(), {"plain": ("none",), "ngram": ("ngram-mod",)})  # type: ignore[arg-type]


def test_n_new_tokens_after_c_cached_cost_the_line_summed_over_their_positions() -> None:
    assert TRUE.seconds(1000, 0) == pytest.approx(1000 * (0.010 + 0.003 * 0.4995))
    assert TRUE.seconds(1000, 15_000) > 4 * TRUE.seconds(1000, 0)
    assert TRUE.seconds(0, 5000) == 0.0
    assert PrefillRate(0.01).seconds(1000, 15_000) == pytest.approx(10.0)  # flat: where it is does not matter


def test_the_fit_recovers_the_line_from_growing_prompts() -> None:
    line = PrefillLine()
    for start in range(0, 16_384, 1024):
        line.add(start, 1024, TRUE.seconds(1024, start), forget=1.0)
    fitted = line.solve(0.0, 0.0, 0.0)
    assert fitted.a_s == pytest.approx(TRUE.a_s, rel=1e-6) and fitted.b_s_per_1k == pytest.approx(0.003, rel=1e-6)


def test_the_slope_prior_follows_the_measured_intercept() -> None:
    # Short prompts only, three times slower than the prior: a 16k prompt is estimated slower by the prior's share
    # of the measured intercept, not by an absolute slope taken from the faster prior.
    line = PrefillLine()
    for _ in range(20):
        line.add(0, 256, 256 * 0.03, forget=1.0)
    fitted = line.solve(0.01, 0.3, 3.0)
    assert 0.025 < fitted.a_s < 0.03  # 20 measurements against the prior's 3
    assert fitted.b_s_per_1k > 2 * 0.3 * 0.01  # not the prior's absolute 3 ms per 1k


def test_noise_never_makes_a_long_prompt_cheaper_per_token() -> None:
    line = PrefillLine()
    line.add(0, 512, 512 * 0.02, forget=1.0)
    line.add(1000, 512, 512 * 0.012, forget=1.0)  # a quieter machine for the second one
    fitted = line.solve(0.01, 0.0, 0.0)
    assert fitted.b_s_per_1k == 0.0 and fitted.a_s > 0


def test_the_speed_model_prices_a_prompt_by_where_its_tokens_are() -> None:
    model = _model(prefill_tps=100.0, prefill_slowdown_per_1k=0.25)
    assert model.basis() == "prior"
    # At the prior: 10 ms a token at the start, 2.5 ms more per 1k.
    assert model.prefill_s("plain", 1000) == pytest.approx(1000 * 0.01 * (1 + 0.25 * 0.4995))
    assert model.prefill_s("plain", 1000, cached=16_000) > 4 * model.prefill_s("plain", 1000)


def test_served_requests_teach_the_slope_of_long_prompts() -> None:
    model = _model(prefill_tps=100.0, prefill_slowdown_per_1k=0.0)  # the old model: one cost per token
    for start in range(0, 16_384, 1024):
        model.observe("plain", 0.0, _timings(start, 1024), body_bytes=0)
    assert model.basis() == "measured"
    true_s = TRUE.seconds(17_938, 0)
    assert model.prefill_s("plain", 17_938) == pytest.approx(true_s, rel=0.1)


def test_a_measurement_at_start_replaces_the_priors() -> None:
    model = _model(prefill_tps=400.0, decode_tps=40.0, prefill_slowdown_per_1k=0.3)
    assert model.calibrate(_timings(0, 300, predicted_n=32, decode_s=0.05), plain=True)
    assert model.basis() == "measured"
    assert model.prefill_rate().a_s == pytest.approx(0.010, rel=0.1)  # the prior said 2.5 ms
    assert model.prefill_rate().b_s_per_1k == pytest.approx(0.3 * model.prefill_rate().a_s, rel=0.01)
    assert 1 / model.decode_s_per_token("plain", 0.0, 0) == pytest.approx(20.0, rel=0.05)
    assert not model.calibrate(_timings(0, 10), plain=True)  # too short to say


def test_a_snapshot_brings_what_was_measured_into_the_next_run() -> None:
    model = _model()
    model.calibrate(_timings(0, 300, predicted_n=32, decode_s=0.05), plain=True)
    for start in range(0, 8192, 1024):
        model.observe("plain", 0.0, _timings(start, 1024, predicted_n=64, decode_s=0.06), body_bytes=4096)
    snapshot = model.snapshot()
    again = _model()
    assert again.restore(snapshot)
    assert again.basis() == "measured"
    assert again.prefill_s("plain", 9000, 3000) == pytest.approx(model.prefill_s("plain", 9000, 3000))
    assert again.decode_s_per_token("plain", 0.0, 4000) == pytest.approx(model.decode_s_per_token("plain", 0.0, 4000))
    assert not _model().restore({**snapshot, "version": 0})
    assert not _model().restore({"version": snapshot["version"], "prefill": "?"})
