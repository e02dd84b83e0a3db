"""The TUI's state: a pure fold of feed events; totals come from records, live figures from progress events."""

from __future__ import annotations

from typing import Any

from adaptive_spec.telemetry.decoding import decode_event
from adaptive_spec.tui.model import Dashboard
from adaptive_spec.tui.render import spark
from adaptive_spec.tui.sessions import client_of

T0 = 1_800_000_000.0


def _feed(board: Dashboard, kind: str, payload: dict[str, Any], now: float) -> None:
    """A feed message as the app folds it in: decoded into its event type, then applied."""
    event = decode_event(kind, payload)
    assert event is not None, kind
    board.apply(event, now)


def _snapshot() -> dict[str, Any]:
    return {
        "profiles": [
            {"name": "oneshot", "base_url": "http://a", "up": True, "spec_types": ["none"], "slots": 1},
            {"name": "iterative", "base_url": "http://b", "up": True, "spec_types": ["ngram-mod"], "slots": 1},
        ],
        "sessions": [{"session_id": "s1", "project": "p", "turns": 0, "est_accepted_share_ewma": None}],
    }


def _record(
    rid: str,
    *,
    sid: str | None = "s1",
    profile: str = "iterative",
    out: int = 100,
    drafted: int = 80,
    accepted: int = 60,
    outcome: str = "finished",
    moved_from: str | None = None,
) -> dict[str, Any]:
    return {
        "request_id": rid,
        "started_at_unix": T0,
        "api": "chat",
        "project": "p",
        "session_id": sid,
        "session_source": "header:x-session-id",
        "profile": profile,
        "status": 200 if outcome == "finished" else 502,
        "outcome": outcome,
        "error": None if outcome == "finished" else "profile down",
        "total_ms": 2000.0,
        "ttft_ms": 100.0,
        "ttst_ms": 150.0,
        "route": "estimate",
        "reason": f"{profile}: because",
        "moved_from": moved_from,
        "handoff": {"ok": True, "tokens": 1234, "save_s": 0.01, "restore_s": 0.005} if moved_from else None,
        "timings": {
            "prompt_n": 10,
            "cache_n": 500,
            "predicted_n": out,
            "predicted_ms": 1000.0,
            "predicted_per_second": float(out),
            "draft_n": drafted,
            "draft_n_accepted": accepted,
        },
    }


def _started(rid: str, sid: str | None = "s1", profile: str = "iterative", at: float = T0) -> dict[str, Any]:
    return {
        "request_id": rid,
        "session_id": sid,
        "project": "p",
        "profile": profile,
        "at_unix": at,
        "session_source": "header:x-session-id",
        "reason": f"{profile}: because",
    }


def test_a_request_folds_into_profile_session_and_log() -> None:
    board = Dashboard()
    board.load_snapshot(_snapshot(), T0)
    _feed(board, "RequestStarted", _started("r1"), T0)
    assert board.profiles["iterative"].busy == 1
    assert board.sessions["s1"].in_flight == "r1"
    assert board.sessions["s1"].client == "opencode"
    _feed(
        board,
        "DraftProgress",
        {
            "request_id": "r1",
            "predicted_n": 40,
            "draft_n": 32,
            "draft_n_accepted": 30,
            "predicted_per_second": 50.0,
            "at_unix": T0 + 0.5,
        },
        T0 + 0.5,
    )
    rate, accept = board.profiles["iterative"].live(T0 + 0.6)
    assert (rate, accept) == (40.0, 0.75)
    _feed(board, "RequestFinished", {"record": _record("r1"), "at_unix": T0 + 0.9}, T0 + 0.9)
    view = board.profiles["iterative"]
    assert view.busy == 0
    # the finish adds the tokens no progress event announced: 60 more output, 30 more accepted
    assert view.live(T0 + 1.0) == (100.0, 0.6)
    assert (view.predicted_n, view.draft_n, view.draft_n_accepted) == (100, 80, 60)
    session = board.sessions["s1"]
    assert (session.predicted_n, session.draft_n, session.draft_n_accepted) == (100, 80, 60)
    assert session.in_flight is None and session.profile == "iterative"
    assert [line.kind for line in board.log] == ["start", "finish"]
    assert "60 from drafts (60%)" in board.log[-1].text


def test_the_window_forgets_after_one_second_and_the_chart_samples_each_second() -> None:
    board = Dashboard()
    board.load_snapshot(_snapshot(), T0)
    board.tick(T0)
    _feed(board, "RequestStarted", _started("r1"), T0)
    _feed(
        board,
        "DraftProgress",
        {"request_id": "r1", "predicted_n": 50, "draft_n": 0, "draft_n_accepted": 25, "at_unix": T0 + 0.2},
        T0 + 0.2,
    )
    assert board.tick(T0 + 1.0)
    assert board.profiles["iterative"].live(T0 + 1.5) == (0.0, None)
    point = board.profiles["iterative"].chart[-1]
    assert (point.tokens_per_s, point.acceptance) == (50.0, 0.5)
    assert board.profiles["oneshot"].chart[-1].acceptance is None


def test_history_and_feed_never_count_a_request_twice() -> None:
    board = Dashboard()
    board.load_snapshot(_snapshot(), T0)
    _feed(board, "RequestFinished", {"record": _record("r1")}, T0)
    assert board.load_requests([_record("r1"), _record("r2", drafted=10, accepted=5)]) == 1
    _feed(board, "RequestFinished", {"record": _record("r2")}, T0)
    assert board.requests_total == 2
    assert board.sessions["s1"].draft_n_accepted == 65
    assert len(board.sessions["s1"].turns) == 2


def test_failures_moves_handoffs_and_estimates() -> None:
    board = Dashboard()
    board.load_snapshot(_snapshot(), T0)
    _feed(board, "RequestFailed", {"record": _record("r1", outcome="failed", out=0, drafted=0, accepted=0)}, T0)
    _feed(board, "RequestFinished", {"record": _record("r2", moved_from="oneshot")}, T0)
    _feed(
        board,
        "HandoffDone",
        {
            "session_id": "s1",
            "from_profile": "oneshot",
            "to_profile": "iterative",
            "ok": True,
            "tokens": 1234,
            "save_s": 0.01,
            "restore_s": 0.005,
            "error": None,
        },
        T0,
    )
    _feed(
        board,
        "SessionUpdated",
        {
            "session_id": "s1",
            "project": "p",
            "est_accepted_share_ewma": 0.7,
            "turn": {"turn": 1, "est_accepted_share": 0.65},
        },
        T0,
    )
    session = board.sessions["s1"]
    assert board.failed_total == 1
    assert session.moves == 1
    assert session.turns[0].est_accepted_share is None  # the failed turn produced nothing to estimate
    assert session.turns[1].est_accepted_share == 0.65
    assert session.turns[1].handoff_tokens == 1234
    assert session.est_copyability == 0.7
    kinds = [line.kind for line in board.log]
    assert kinds == ["fail", "finish", "handoff"]
    assert "✗ 502 profile down" in board.log[0].text
    assert "1,234 tok in 15 ms" in board.log[2].text


def test_profile_health_and_dropped_events_are_shown() -> None:
    board = Dashboard()
    board.load_snapshot(_snapshot(), T0)
    _feed(board, "ProfileDown", {"profile": "oneshot", "base_url": "http://a", "reason": "exited"}, T0)
    assert not board.profiles["oneshot"].up and board.profiles["oneshot"].reason == "exited"
    _feed(board, "ProfileUp", {"profile": "oneshot", "base_url": "http://a"}, T0)
    assert board.profiles["oneshot"].up
    _feed(board, "EventsDropped", {"count": 7}, T0)
    assert board.dropped_events == 7
    assert "7 events dropped" in board.log[-1].text


def test_queue_and_slots() -> None:
    board = Dashboard()
    board.load_snapshot(_snapshot(), T0)
    for i in range(3):
        _feed(board, "RequestStarted", _started(f"r{i}", sid=f"s{i}"), T0)
    view = board.profiles["iterative"]
    assert (view.busy, view.queued) == (1, 2)


def test_live_text_is_kept_with_its_draft_marks_and_bounded() -> None:
    board = Dashboard()
    _feed(board, "RequestStarted", _started("r1"), T0)
    _feed(
        board,
        "DraftProgress",
        {
            "request_id": "r1",
            "predicted_n": 3,
            "draft_n_accepted": 2,
            "text": [["def ", True], ["f", True], ["(", False]],
        },
        T0,
    )
    live = board.live["r1"]
    assert board.live_text
    assert list(live.text) == [("def ", True), ("f", True), ("(", False)]
    _feed(
        board,
        "DraftProgress",
        {"request_id": "r1", "predicted_n": 4, "draft_n_accepted": 2, "text": [["x" * 5000, False]]},
        T0,
    )
    assert live.text_chars <= 5000 and list(live.text) == [("x" * 5000, False)]


def test_client_names() -> None:
    assert client_of("header:x-session-id") == "opencode"
    assert client_of("header:session-id") == "codex"
    assert client_of("echo:reply") == "?"
    assert client_of("echo:reply", "aider") == "aider"


def test_sparkline_scales_to_its_peak() -> None:
    assert spark([0, 1, 2, 4], 10) == "▁▃▅█"
    assert spark([5, 5], 1) == "█"
    assert spark([], 5) == ""
    assert spark([0.0, 0.0], 5) == "▁▁"


def test_route_gives_the_policy_files_and_earlier_pins() -> None:
    from adaptive_spec.tui.render import status_line

    board = Dashboard()
    board.load_route({"policy": {"sources": ["/etc/x/default.toml", "proj.toml"]}, "pins": {"s1": "iterative"}})
    assert board.policy_sources == ("/etc/x/default.toml", "proj.toml")
    assert board.sessions["s1"].pinned == "iterative"
    line = status_line(board, url="u", connected=True, since=T0, paused=False, now=T0 + 5).plain
    assert "policy default.toml + proj.toml" in line


def test_speeds_fit_their_columns() -> None:
    from adaptive_spec.tui.render import num

    assert num(8363.24) == "8,363"
    assert num(48.25) == "48.2"
    assert num(None) == "—"


def test_a_remote_prefill_is_one_log_line_and_so_is_its_fallback() -> None:
    from adaptive_spec.telemetry.events import RemotePrefillDone

    done = RemotePrefillDone(
        session_id="s1",
        profile="main",
        relay="http://ppserver:8095",
        ok=True,
        reason=None,
        tokens=3412,
        bytes=41_000_000,
        remote_prefill_s=0.5,
        save_s=0.02,
        transfer_s=0.25,
        restore_s=0.03,
        error=None,
        at_unix=T0,
    )
    fell_back = RemotePrefillDone(
        session_id="s2",
        profile="main",
        relay="http://ppserver:8095",
        ok=False,
        reason="checksum",
        tokens=0,
        bytes=0,
        remote_prefill_s=0.0,
        save_s=0.0,
        transfer_s=0.0,
        restore_s=0.0,
        error="sha256 differs",
        at_unix=T0,
    )
    board = Dashboard()
    for event in (done, fell_back):
        payload = event.to_json()
        _feed(board, payload.pop("type"), payload, T0)
    assert [(line.kind, line.who) for line in board.log] == [("handoff", "s1"), ("handoff", "s2")]
    assert board.log[0].text == (
        "remote prefill: 3,412 tok, 41.0 MB back to main (prefill 500 ms · transfer 250 ms · restore 30 ms)"
    )
    assert board.log[1].text == "remote prefill failed (checksum: sha256 differs); prefilled here"


def test_a_turn_says_which_speculation_it_ran_with() -> None:
    from adaptive_spec.telemetry.decoding import decode_record
    from adaptive_spec.tui.render import turn_reason
    from adaptive_spec.tui.sessions import setting_text, turn_row

    assert setting_text(None) is None  # nothing named: the server's own setup, nothing to say
    assert setting_text({"types": [], "n_max": None, "set_by": "profile"}) == "none (set by the profile)"
    capped = {"types": ["draft-simple"], "n_max": 4, "set_by": "router"}
    assert setting_text(capped) == "draft-simple n_max=4 (set by the router)"
    record = decode_record(
        {
            "request_id": "r1",
            "profile": "oneshot",
            "route": "estimate",
            "reason": "oneshot: copyable 0% (no history), drafter accepts 80% (2-turn avg)",
            "speculation": capped,
            "outcome": "finished",
        }
    )
    text = turn_reason(2, turn_row(record)).plain
    assert text.startswith("turn 2 → oneshot (estimate): ran with speculation draft-simple n_max=4 (set by the router)")
    assert text.endswith("drafter accepts 80% (2-turn avg)")


def test_a_session_that_drafted_nothing_shows_no_acceptance_rather_than_none_accepted() -> None:
    board = Dashboard()
    board.load_snapshot(_snapshot(), T0)
    _feed(board, "RequestFinished", {"record": _record("r1", profile="oneshot", drafted=0, accepted=0)}, T0)
    session = board.sessions["s1"]
    assert session.predicted_n == 100 and session.accepted_share is None
    assert session.turns[-1].accepted_share is None
    _feed(board, "RequestFinished", {"record": _record("r2", drafted=80, accepted=0)}, T0 + 1)
    assert session.accepted_share == 0.0  # drafted and none accepted: 0%, not "—"


def test_a_request_counted_again_replaces_its_turn_and_nothing_else() -> None:
    board = Dashboard()
    board.load_snapshot(_snapshot(), T0)
    _feed(board, "RequestFinished", {"record": _record("r1", drafted=0, accepted=0), "at_unix": T0 + 1}, T0 + 1)
    before = board.requests_total
    counted = _record("r1", out=120, drafted=90, accepted=70)  # llama-server's counters: its drafts too
    _feed(board, "RequestCounted", {"record": counted, "before": {}, "at_unix": T0 + 2}, T0 + 2)
    (turn,) = board.sessions["s1"].turns
    assert (turn.predicted_n, turn.draft_n_accepted) == (120, 70)
    assert board.requests_total == before  # the same request, not another one


def test_a_finish_line_says_how_far_the_prefill_estimate_was() -> None:
    board = Dashboard()
    board.load_snapshot(_snapshot(), T0)
    estimate = {"basis": "measured", "prefill_s_est": 61.5, "prefill_s": 57.6, "prefill_error": 0.0677}
    record = {**_record("r1"), "time_estimate": estimate}
    _feed(board, "RequestFinished", {"record": record, "at_unix": T0 + 1}, T0 + 1)
    assert "prefill est +7% (measured)" in board.log[-1].text
    _feed(board, "RequestFinished", {"record": _record("r2"), "at_unix": T0 + 2}, T0 + 2)
    assert "prefill est" not in board.log[-1].text  # no estimate to judge (a recorded feed's, a pinned route's)
