"""The remote prefill cost model (`kv/remote_prefill/pricing.py`) and the relay's slot-file names, table-driven."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptive_spec.kv.costs import PrefillRate
from adaptive_spec.kv.relay_client import PARTIAL_PREFIX
from adaptive_spec.kv.remote_prefill.pricing import RemoteCosts, RemoteMeasurement, RemotePrefillPolicy, choose
from adaptive_spec.kv.remote_prefill.shell import sweep_partial_downloads
from adaptive_spec.kv.slot_files import model_mismatch, valid_relay_name, valid_slot_name

LOCAL_10_TPS = 0.1  # seconds per token: the public proposal's weak local box


def _costs(**policy: float) -> RemoteCosts:
    return RemoteCosts(RemotePrefillPolicy(**policy))  # type: ignore[arg-type]


def test_the_proposals_case_goes_remote_and_says_by_how_much() -> None:
    # 50k tokens at 10 tok/s here (5,000 s) vs a 2,000 tok/s remote, 120 kB/token over 1 Gbit/s (~60 s).
    choice = choose(50_000, 50_000, PrefillRate(LOCAL_10_TPS), _costs())
    assert choice.remote and choice.local_s == pytest.approx(5000.0)
    assert 60 < choice.remote_s < 120 and choice.transfer_s == pytest.approx(60.0)
    assert choice.reason.startswith("remote prefill of 50,000 tokens saves 4,9") and "transfer 60.0 s" in choice.reason


@pytest.mark.parametrize(
    ("new_tokens", "local_s_per_token", "bandwidth", "remote"),
    [
        (1_000, LOCAL_10_TPS, 100e6, False),  # under min_tokens: never worth a round trip
        (50_000, 1 / 3000, 100e6, False),  # a local box faster than the remote
        (50_000, LOCAL_10_TPS, 1e6, False),  # 6 GB over 8 Mbit/s: 6,000 s of transfer
        (50_000, LOCAL_10_TPS, 1.25e9, True),  # 10 Gbit/s
    ],
)
def test_the_choice_follows_the_terms(
    new_tokens: int, local_s_per_token: float, bandwidth: float, remote: bool
) -> None:
    choice = choose(new_tokens, new_tokens, PrefillRate(local_s_per_token), _costs(bandwidth_bytes_per_s=bandwidth))
    assert choice.remote is remote, choice.reason


def test_the_margin_keeps_a_near_tie_here() -> None:
    costs = _costs(margin=0.25)
    tokens = 50_000
    remote_s = costs.remote_s(tokens)
    assert not choose(tokens, tokens, PrefillRate(remote_s * 1.2 / tokens), costs).remote
    assert choose(tokens, tokens, PrefillRate(remote_s * 1.3 / tokens), costs).remote


def test_the_remote_prices_the_whole_context_a_slot_file_carries() -> None:
    # 2,000 new tokens after 48,000 already cached here: the file holds 50,000.
    choice = choose(2_000, 50_000, PrefillRate(LOCAL_10_TPS), _costs())
    assert not choice.remote and choice.local_s == pytest.approx(200.0) and choice.remote_s > 60


def test_the_local_cost_grows_with_the_positions_it_prefills_at() -> None:
    # The 0.5B on 2 CPU cores: a token at 16k costs several times one at the start (docs/benchmarks.md).
    slowing = PrefillRate(1 / 100, (1 / 100) * 0.25)
    late = choose(4_000, 20_000, slowing, _costs())
    early = choose(4_000, 4_000, slowing, _costs())
    # 4,000 tokens at a mean position of 18k against 2k: 1 + 0.25·18 against 1 + 0.25·2, per token.
    assert late.local_s == pytest.approx(40.0 * 5.5, rel=1e-3) and early.local_s == pytest.approx(40.0 * 1.5, rel=1e-3)
    assert late.remote and not choose(4_000, 20_000, PrefillRate(1 / 100), _costs()).remote, late.reason


def test_measurements_replace_the_priors() -> None:
    costs = _costs()
    slow_link = RemoteMeasurement(
        tokens=4_000,
        prompt_n=4_000,
        prefill_s=0.4,
        round_trip_s=0.01,
        save_s=0.05,
        file_bytes=4_000 * 12_300,
        transfer_s=49.2,  # 1 MB/s
        restore_s=0.05,
    )
    costs.observe(slow_link)
    assert costs.link.bytes_per_token() == pytest.approx(12_300, rel=0.1)  # a fact of the model: one file tells it
    for _ in range(19):
        costs.observe(slow_link)
    assert costs.link.bandwidth_bytes_per_s() == pytest.approx(1e6, rel=0.2)
    assert 6_000 < 1 / costs.s_per_token() < 10_000  # from the 2,000 prior toward the measured 10,000
    assert not choose(50_000, 50_000, PrefillRate(1 / 100), costs).remote  # 615 s of transfer vs 500 s here


def test_a_probe_of_the_link_counts_before_any_transfer() -> None:
    costs = _costs()
    costs.observe_link(0.002, 100_000.0)
    assert costs.link.bandwidth_bytes_per_s() < 1e6


def test_forced_goes_remote_whatever_the_estimate() -> None:
    choice = choose(10, 10, PrefillRate(1 / 1e6), _costs(force=True))
    assert choice.remote and "forced" in choice.reason


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("as-pp-0123abc-1.bin", True),
        ("slot_0.bin", True),
        ("a", True),
        ("x" * 128, True),
        ("x" * 129, False),
        ("", False),
        (".", False),
        ("..", False),
        (".hidden", False),
        (".part-abc", False),
        ("a/b", False),
        ("../x", False),
        ("a..b", False),
        ("a\\b", False),
        ("a b", False),
        ("ü.bin", False),
        ("a\0b", False),
        ("a.bin\n", False),  # `$` alone would let a final newline through
        ("a.bin\r", False),
        ("a\u0660.bin", False),  # a unicode digit
        ("\uff41.bin", False),  # a fullwidth letter
    ],
)
def test_slot_file_names(name: str, ok: bool) -> None:
    assert valid_slot_name(name) is ok


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("as-pp-0123-1.bin", True),
        ("as-x", True),
        ("chat.bin", False),
        ("as-a/b", False),
        ("as-..x", False),
        ("AS-x", False),
    ],
)
def test_a_relay_handles_only_the_names_adaptive_spec_gives(name: str, ok: bool) -> None:
    assert valid_relay_name(name) is ok


def test_a_model_mismatch_names_both_hashes() -> None:
    here, there = "a" * 64, "b" * 64
    assert model_mismatch(here, here, "x") is None
    message = model_mismatch(there, here, "--pp-server http://big:8095")
    assert message is not None and here in message and there in message and "--pp-server http://big:8095" in message


def test_the_proxy_sweeps_its_own_partial_downloads_only(tmp_path: Path) -> None:
    leftovers = [tmp_path / f"{PARTIAL_PREFIX}{n}" for n in ("a1", "b2")]
    keep = [tmp_path / "as-pp-kept.bin", tmp_path / ".part-relay-upload", tmp_path / "mine.bin"]
    for path in leftovers + keep:
        path.write_bytes(b"x")
    assert sweep_partial_downloads(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in keep)
