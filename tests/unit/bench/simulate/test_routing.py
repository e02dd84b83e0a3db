"""The simulator at the public GPU benchmark's speeds: the routing policy takes the best of both static profiles."""

from __future__ import annotations

import pytest

from adaptive_spec.bench.runner import load_workload, main_simulate
from adaptive_spec.bench.simulate.routing import CPU, GPU, public_mix, requests_from_workload, simulate_targets


def test_public_mix_at_gpu_speeds_matches_the_published_arithmetic() -> None:
    plain, ngram, adaptive, noisy, oracle = simulate_targets(public_mix(), GPU)
    tokens = {r.klass: 0 for r in public_mix()}
    for r in public_mix():
        tokens[r.klass] += r.output_tokens
    assert tokens["iterative"] == tokens["oneshot"]  # a 50/50 token mix
    # Per request the better profile: 2 / (1/176.1 + 1/304.3) tok/s, 1.2× always-DFlash, 1.02× always-DFlash+ngram.
    assert oracle.decode_tok_s == pytest.approx(2 / (1 / 176.1 + 1 / 304.3))
    assert oracle.decode_tok_s / plain.decode_tok_s == pytest.approx(1.195, abs=0.005)
    assert oracle.decode_tok_s / ngram.decode_tok_s == pytest.approx(1.021, abs=0.005)
    # The policy, learning its speeds as it goes, gets within 3% of the oracle and keeps one-shot TTST at DFlash's.
    assert adaptive.decode_tok_s >= 0.97 * oracle.decode_tok_s
    assert noisy.decode_tok_s >= 0.97 * oracle.decode_tok_s  # copyability estimates off by up to ±30%
    assert adaptive.ttst_ms_median_oneshot == pytest.approx(30.5)
    assert ngram.ttst_ms_median_oneshot is not None and adaptive.ttst_ms_median_oneshot is not None
    assert ngram.ttst_ms_median_oneshot / adaptive.ttst_ms_median_oneshot == pytest.approx(2.27, abs=0.01)


@pytest.mark.parametrize("scenario", [GPU, CPU], ids=["gpu", "cpu"])
@pytest.mark.parametrize("workload", ["iterative", "oneshot", "mixed"])
def test_adaptive_is_never_worse_than_the_better_static_profile(scenario: object, workload: str) -> None:
    requests = requests_from_workload(load_workload(workload))
    plain, ngram, adaptive, noisy, oracle = simulate_targets(requests, scenario)  # type: ignore[arg-type]
    for routed in (adaptive, noisy):
        assert routed.decode_tok_s >= 0.98 * max(plain.decode_tok_s, ngram.decode_tok_s)
        assert routed.decode_tok_s >= 0.97 * oracle.decode_tok_s
    # One-shot prompts keep the plain profile's time to second token; nothing is slower to start than on n-gram.
    if plain.ttst_ms_median_oneshot is not None and adaptive.ttst_ms_median_oneshot is not None:
        assert adaptive.ttst_ms_median_oneshot <= 1.05 * plain.ttst_ms_median_oneshot
    assert adaptive.ttst_ms_median <= ngram.ttst_ms_median


def test_simulate_command_writes_its_tables(tmp_path: object) -> None:
    from pathlib import Path

    out = Path(str(tmp_path))
    text = main_simulate("gpu", ["mixed"], out)
    assert "public benchmark mix" in text and "| adaptive |" in text and "| oracle (per request) |" in text
    assert (out / "simulate-gpu.md").read_text().strip() == text.strip()
