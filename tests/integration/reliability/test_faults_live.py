"""Faults against real profiles (tiny model), by the scenarios of tests/stress/faults.py: a profile killed or stopped
mid-stream, one that never becomes healthy, a full disk under the trace and the slot directory, KV handoffs that
fail half way."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.stress import faults


def test_a_killed_profile_is_passed_over_and_rejoins(tmp_path: Path, llama_server_binary: str) -> None:
    figures = faults.sigkill(tmp_path)
    assert figures["client_error"] == "upstream_disconnected", figures
    assert figures["other_profile_stream"] == {"finished": True, "error_events": 0}, figures
    while_down = figures["requests_while_down"]
    assert while_down["sent"] >= 1 and while_down["statuses"] == {200: while_down["sent"]}, figures
    assert while_down["went_to"] == {"iterative": while_down["sent"]}, figures
    assert while_down["reason_says_down"] == while_down["sent"], figures
    assert figures["new_pid"] and figures["pinned_request_after_rejoin"] == 200 and figures["restart_said"], figures


def test_a_stopped_profile_times_out_and_frees_its_slot_when_continued(
    tmp_path: Path, llama_server_binary: str
) -> None:
    figures = faults.sigstop(tmp_path)
    assert figures["stream_error"] == "upstream_timeout" and figures["new_request_status"] == 504, figures
    assert figures["other_profile_status"] == 200 and figures["request_after_sigcont"] == 200, figures
    assert [status for status, _, _ in figures["records"]] == [200, 504], figures
    assert all(outcome == "failed" for _, outcome, _ in figures["records"]), figures
    # Silence for the read timeout ends each: not sooner (a stopped server is not a slow one), and not much later.
    timeout_s = figures["read_timeout_s"]
    for waited in (figures["stream_error_after_s"], figures["new_request_after_s"]):
        assert timeout_s * 0.9 <= waited <= timeout_s + 5.0, figures


def test_a_profile_that_never_becomes_healthy(tmp_path: Path) -> None:
    figures = faults.never_healthy(tmp_path, timeout_s=2.0)
    assert figures["exit_status"] != 0 and "was not healthy after 2 s" in figures["error_line"], figures
    assert figures["log_is_there"] and figures["log_tail_in_message"], figures  # the log it names can be read
    assert figures["left_running"] == 0, figures


def test_a_trace_on_a_full_device_does_not_stop_the_proxy(tmp_path: Path, llama_server_binary: str) -> None:
    figures = faults.trace_full(tmp_path)
    assert figures["statuses"] == {200: 5}, figures
    assert figures["health_trace"] == {"writing": False, "dropped_lines": 6}, figures  # the profiles line, 5 requests
    assert len(figures["console_lines"]) == 1, figures  # said once, not once per request


def test_a_full_disk_under_the_trace_and_the_slot_directory(tmp_path: Path, llama_server_binary: str) -> None:
    why = faults.can_mount()
    if why is not None:
        pytest.skip(why)
    figures = faults.disk_full(tmp_path)
    assert figures["statuses_while_full"] == {200: 4} and figures["moved_status"] == 200, figures
    assert figures["moved_handoff"]["ok"] is False and "save" in figures["moved_handoff"]["error"], figures
    assert figures["health_trace_while_full"]["writing"] is False, figures
    assert figures["status_after_space_freed"] == 200 and figures["health_trace_after"]["writing"], figures
    assert figures["last_trace_line_parses"], figures


@pytest.mark.parametrize("scenario", [faults.cut_slot_file, faults.restore_answer_lost], ids=["cut", "answer-lost"])
def test_a_handoff_that_fails_half_way_still_answers_the_same_text(
    tmp_path: Path, llama_server_binary: str, scenario: faults.Scenario
) -> None:
    figures = scenario(tmp_path)
    assert figures["injected"] and figures["status"] == 200 and figures["moved_from"] == "a", figures
    assert figures["handoff"]["ok"] is False and figures["handoffs"] == {"ok": 0, "failed": 1}, figures
    assert figures["text_equals_fresh_server"] and figures["next_turn_equals_fresh_server"], figures
    assert figures["target_alive"], figures  # llama-server aborts when it restores a slot file cut short
