"""The arithmetic beyond one machine: remote prefill (the public proposal's case) and a pool of replicas under a day
of agent traffic."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptive_spec.bench.runner import load_workload, main_simulate
from adaptive_spec.bench.simulate.pool import PoolAssumptions, simulate_pool
from adaptive_spec.bench.simulate.remote import ARCH_27B, QWEN_05B, Assumptions, remote_row
from adaptive_spec.bench.simulate.routing import SimRequest, requests_from_workload


def test_kv_bytes_per_token_follow_the_architecture() -> None:
    assert QWEN_05B.kv_bytes_per_token("f16") == 12_288  # slot files measured 12.3 kB a token here
    assert ARCH_27B.kv_bytes_per_token("f16") == 262_144
    assert ARCH_27B.kv_bytes_per_token("q8_0") == 64 * 8 * 128 * 2 * 34 / 32
    assert ARCH_27B.kv_bytes_per_token("q4_0") == 64 * 8 * 128 * 2 * 18 / 32


def test_the_proposals_case_by_hand() -> None:
    a = Assumptions()
    row = remote_row(a, ARCH_27B, "f16", 1.0, 10.0)
    size = 50_000 * 262_144
    assert row.local_s == 5_000.0  # 50k tokens at 10 tok/s: the proposal's hour and a half
    assert row.transfer_s == pytest.approx(size / 125e6)
    assert row.remote_s == pytest.approx(1.0 + 10.0 + size / 340e6 + size / 125e6 + size / 1e9)
    assert row.remote_s < 180  # "under three minutes with transfer and start-up"
    # Break-even: the start-up over what each token saves.
    per_token = 1 / 5000 + 262_144 * (1 / 340e6 + 1 / 125e6 + 1 / 1e9)
    assert row.break_even_tokens == int(1.0 / (0.1 - per_token)) + 1
    assert remote_row(a, ARCH_27B, "f16", 1.0, 2000.0).break_even_tokens is None  # a fast local box never gains


def _templates() -> list[list[SimRequest]]:
    by_session: dict[str, list[SimRequest]] = {}
    for r in requests_from_workload(load_workload("mixed")):
        by_session.setdefault(r.session, []).append(r)
    return list(by_session.values())


def test_a_pool_keeps_sessions_on_their_kv_and_passes_over_a_replica_that_is_down() -> None:
    small = PoolAssumptions(sessions=200, day_s=3 * 3600.0, requests_per_session=(5, 20))
    rows = {s: simulate_pool(_templates(), s, small) for s in ("adaptive-spec", "sticky hash", "round robin")}
    assert len({r.requests for r in rows.values()}) == 1  # the same traffic for each
    assert rows["sticky hash"].moves == 0 and rows["sticky hash"].re_prefilled_moved == 0
    assert rows["adaptive-spec"].moves < rows["round robin"].moves / 10
    assert rows["adaptive-spec"].re_prefilled_moved < rows["round robin"].re_prefilled_moved / 10
    assert max(rows["adaptive-spec"].sessions_per_replica) - min(rows["adaptive-spec"].sessions_per_replica) <= 20
    down = PoolAssumptions(sessions=200, day_s=3 * 3600.0, requests_per_session=(5, 20), down=(3, 4000.0, 9000.0))
    row = simulate_pool(_templates(), "adaptive-spec", down)
    assert row.requests == rows["adaptive-spec"].requests  # every request served, some on another replica
    assert row.moves > rows["adaptive-spec"].moves and row.re_prefilled_moved > 0  # re-placed, re-prefilled


@pytest.mark.parametrize("name", ["pp-remote", "pool"])
def test_the_scale_simulations_print_their_assumptions(name: str, tmp_path: Path) -> None:
    text = main_simulate(name, [], tmp_path)
    assert "assumptions:" in text and (tmp_path / f"simulate-{name}.md").read_text().strip() == text
