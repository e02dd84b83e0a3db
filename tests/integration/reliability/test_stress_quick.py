"""Quick runs of the load and shutdown scripts (tests/stress/): seconds, not minutes. The long runs are on demand
(see the README)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.stress.load import HISTORY, MAX_SESSIONS, run_fake, run_real
from tests.stress.shutdown import run_shutdown


def _check_load(figures: dict[str, object], requests_at_least: int) -> None:
    assert figures["errors"] == 0 and figures["wrong_text"] == 0, figures
    assert isinstance(figures["requests"], int) and figures["requests"] >= requests_at_least, figures
    assert figures["request_ids_unique"] and figures["history_total"] == figures["requests"], figures
    trace = figures["trace"]
    assert isinstance(trace, dict) and trace["recorded_exactly_once"] and trace["not_sent_by_a_client"] == 0, trace
    tables = figures["tables"]
    assert isinstance(tables, dict)
    assert tables["history_kept"] <= HISTORY and tables["sessions_kept"] <= MAX_SESSIONS, tables
    assert set(tables["router_in_flight_after"].values()) == {0}, tables


def test_sixteen_streaming_clients_against_a_fast_upstream(tmp_path: Path) -> None:
    figures = asyncio.run(run_fake(16, 5.0, tmp_path / "trace.jsonl"))
    _check_load(figures, 16)
    samples = figures["proxy_process"]
    # Nothing held on to: descriptors back to where they were once pooled connections expire, memory not doubling.
    assert samples["idle_after"]["fds"] <= samples["start"]["fds"], samples
    assert samples["end"]["rss_kib"] < 2 * samples["start"]["rss_kib"], samples


def test_more_clients_than_slots_on_launched_profiles(tmp_path: Path, llama_server_binary: str) -> None:
    figures = asyncio.run(run_real(12, 5.0, 2, tmp_path, max_tokens=32))
    _check_load(figures, 12)


def test_sigterm_with_sixteen_streams_in_flight(tmp_path: Path, llama_server_binary: str) -> None:
    figures = run_shutdown(16, 2.0, tmp_path)
    assert figures["whole_or_clean_error"] == 16, figures  # none cut off without a word, none hanging
    assert set(figures["error_codes"]) <= {"proxy_shutting_down"}, figures
    assert figures["proxy_exit_status"] == 0 and figures["llama_servers_after"] == 0, figures
    # Both launched profiles run on one patched llama-server (per-request speculation): one process to stop.
    assert figures["llama_servers_before"] == 1, figures
