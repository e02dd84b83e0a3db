"""The TUI's profile table with a pool: one line per replica under its profile, health per replica, the profile up
while one of them serves, and every line readable at 80 columns."""

from __future__ import annotations

from typing import Any

from adaptive_spec.telemetry.decoding import decode_event
from adaptive_spec.tui import render
from adaptive_spec.tui.model import Dashboard


def _feed(board: Dashboard, kind: str, payload: dict[str, Any], now: float) -> None:
    """A feed message as the app folds it in: decoded into its event type, then applied."""
    event = decode_event(kind, payload)
    assert event is not None, kind
    board.apply(event, now)


def _record(rid: str, replica: int) -> dict[str, object]:
    return {
        "request_id": rid,
        "started_at_unix": 100.0,
        "profile": "iterative",
        "replica": replica,
        "status": 200,
        "outcome": "finished",
        "session_id": "s1",
        "project": "default",
        "timings": {"predicted_n": 100, "draft_n": 90, "draft_n_accepted": 80, "predicted_ms": 1000.0},
    }


def test_a_pool_shows_one_line_per_replica_and_its_health() -> None:
    board = Dashboard()
    replicas = [
        {"replica": i, "base_url": f"http://gpu-box-{i}.lan:8080", "up": True, "slots": 4, "requests": 0}
        for i in range(2)
    ]
    profile = {"name": "iterative", "up": True, "spec_types": ["ngram-mod"], "slots": 4, "replicas": replicas}
    board.load_snapshot({"profiles": [profile]}, 100.0)
    started = {"request_id": "r1", "profile": "iterative", "replica": 1, "session_id": "s1", "at_unix": 100.0}
    _feed(board, "RequestStarted", started, 100.0)
    view = board.profiles["iterative"]
    assert view.replicas[1].in_flight == {"r1"}
    _feed(board, "RequestFinished", {"record": _record("r1", 1), "at_unix": 101.0}, 101.0)
    assert (view.replicas[1].requests, view.replicas[1].acceptance, view.replicas[1].in_flight) == (1, 0.8, set())
    down = {"profile": "iterative", "base_url": "http://gpu-box-0.lan:8080", "reason": "refused connections"}
    _feed(board, "ProfileDown", {**down, "replica": 0, "profile_down": False, "at_unix": 102.0}, 102.0)
    assert view.up and not view.replicas[0].up
    assert board.log[-1].who == "iterative#0" and "refused connections" in board.log[-1].text
    for narrow in (True, False):
        lines = render.profile_lines(view, 102.0, narrow=narrow).plain.split("\n")
        assert len(lines) == 3
        assert lines[1].startswith("  ○ #0 gpu-box-0.lan:8080") and "down: refused connections" in lines[1]
        assert lines[2].startswith("  ● #1 gpu-box-1.lan:8080") and "req 1" in lines[2] and "80%" in lines[2]
        if narrow:  # the 80-column layout: 76 columns inside the border and padding (the down reason may run on)
            assert all(len(line.split("  down:")[0]) <= 76 for line in lines), lines
    _feed(board, "ProfileDown", {**down, "replica": 1, "profile_down": True, "at_unix": 103.0}, 103.0)
    assert not view.up


def test_a_replicas_requests_are_counted_once_when_the_history_follows_the_snapshot() -> None:
    # Seen on a live pool: the snapshot's per-replica count plus the same requests again from /adaptive/requests.
    board = Dashboard()
    replicas = [
        {"replica": i, "base_url": f"http://h{i}:8080", "up": True, "slots": 2, "requests": 2} for i in range(2)
    ]
    board.load_snapshot({"profiles": [{"name": "iterative", "up": True, "replicas": replicas}]}, 100.0)
    board.load_requests([_record(f"r{i}", i % 2) for i in range(4)])
    assert [board.profiles["iterative"].replicas[i].requests for i in range(2)] == [2, 2]
