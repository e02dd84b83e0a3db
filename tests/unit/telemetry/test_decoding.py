"""Feed messages read back as the project's event types: every type round-trips, the recorded feed reads back with
every field it holds, and a message of an older or newer proxy still reads (unknown kinds skipped, unknown fields
ignored, missing ones defaulted), so a newer proxy cannot crash an older TUI."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import orjson

from adaptive_spec.telemetry.decoding import decode_event, decode_record
from adaptive_spec.telemetry.events import (
    DraftProgress,
    Event,
    EventsDropped,
    HandoffDone,
    PolicyChanged,
    ProfileDown,
    ProfileUp,
    RemotePrefillDone,
    RequestCounted,
    RequestFailed,
    RequestFinished,
    RequestStarted,
    SessionPinned,
    SessionUpdated,
)
from adaptive_spec.telemetry.records import RequestRecord, Timings

FEED = Path(__file__).parents[2] / "tui" / "data" / "feed.jsonl"
T0 = 1_800_000_000.0

ONE_OF_EACH: list[Event] = [
    RequestStarted("r1", "chat", "p", "iterative", "s1", "header:x-session-id", True, route="estimate", replica=1),
    DraftProgress("r1", "iterative", 40, 32, 30, 50.0, text=[("def ", True), ("f", False)]),
    RequestFinished({"request_id": "r1", "timings": {"predicted_n": 40}}),
    RequestFailed({"request_id": "r2", "outcome": "failed", "timings": None}),
    RequestCounted({"request_id": "r2", "timings": {"prompt_n": 9, "predicted_n": 30}}, {}),
    SessionUpdated("s1", "p", {"turn": 1, "est_accepted_share": 0.5}, 0.4, request_id="r1"),
    ProfileUp("iterative", "http://a", replica=1),
    ProfileDown("iterative", "http://a", "exited", replica=1, profile_down=False),
    HandoffDone("s1", "oneshot", "iterative", True, 1234, 0.01, 0.005, None, to_replica=1),
    RemotePrefillDone("s1", "main", "http://pp:8095", False, "checksum", 0, 0, 0.0, 0.0, 0.0, 0.0, "sha256 differs"),
    SessionPinned("s1", None),
    PolicyChanged("policy reloaded"),
    EventsDropped(7),
]


def _message(event: Event) -> tuple[str, dict[str, Any]]:
    """The event as the feed carries it: its name, and its JSON object as the client parses it."""
    data = orjson.loads(orjson.dumps(event.to_json()))
    return data["type"], data


def test_every_event_type_reads_back_as_itself() -> None:
    assert {type(e) for e in ONE_OF_EACH} == set(get_args(Event))
    for event in ONE_OF_EACH:
        assert decode_event(*_message(event)) == event


def test_the_recorded_feed_reads_back_without_losing_a_field() -> None:
    # Recorded by an older proxy: its events lack fields added since (a request's `replica`), which read as defaults.
    lines = [orjson.loads(raw) for raw in FEED.read_bytes().splitlines() if raw.strip()]
    kinds = set()
    for line in lines:
        event = decode_event(line["type"], line)
        if line["type"] == "snapshot":  # the feed's first message, not an event: the caller reads it
            assert event is None
            continue
        assert event is not None, line["type"]
        again = orjson.loads(orjson.dumps(event.to_json()))
        assert {key: again.get(key) for key in line} == line
        kinds.add(type(event))
    assert {RequestStarted, DraftProgress, RequestFinished, SessionUpdated, HandoffDone} <= kinds


def test_an_unknown_kind_is_skipped() -> None:
    assert decode_event("SlotEvicted", {"slot": 3, "at_unix": T0}) is None
    assert decode_event("snapshot", {"profiles": []}) is None


def test_unknown_fields_are_ignored_and_missing_ones_defaulted() -> None:
    kind, data = _message(ProfileDown("iterative", "http://a", "exited", replica=2, profile_down=False, at_unix=T0))
    newer = decode_event(kind, {**data, "gpu": "H200", "slot_ids": [0, 1]})
    assert newer == ProfileDown("iterative", "http://a", "exited", replica=2, profile_down=False, at_unix=T0)
    older = decode_event("ProfileDown", {"profile": "iterative", "base_url": "http://a", "reason": "exited"})
    assert older == ProfileDown("iterative", "http://a", "exited", replica=0, profile_down=True, at_unix=0.0)


def test_a_field_without_a_default_reads_as_the_empty_value_of_its_type() -> None:
    started = decode_event("RequestStarted", {"request_id": "r1", "profile": "iterative"})
    assert started == RequestStarted("r1", "", "", "iterative", None, None, False, at_unix=0.0)
    finished = decode_event("RequestFinished", {})
    assert finished == RequestFinished({}, at_unix=0.0)


def test_values_of_the_wrong_json_type_take_the_default() -> None:
    progress = decode_event(
        "DraftProgress",
        {
            "request_id": 7,  # not a string
            "profile": "iterative",
            "predicted_n": 40.0,  # a whole number written as a float still counts
            "draft_n": True,  # a boolean is not a count
            "draft_n_accepted": "30",
            "predicted_per_second": None,
            "text": [["ok", True], ["too", "many", "items"], "not a pair"],
            "at_unix": "yesterday",
        },
    )
    assert progress == DraftProgress("", "iterative", 40, 0, 0, 0.0, text=[("ok", True)], at_unix=0.0)
    assert decode_event("DraftProgress", {"text": "not a list"}) == DraftProgress("", "", 0, 0, 0, 0.0, at_unix=0.0)
    handoff = decode_event("HandoffDone", {"ok": 1, "save_s": "0.1", "error": 5})
    assert isinstance(handoff, HandoffDone)
    assert (handoff.ok, handoff.save_s, handoff.error) == (False, 0.0, None)


def test_decoded_events_share_no_container() -> None:
    first, second = decode_event("RequestFinished", {}), decode_event("RequestFinished", {})
    assert isinstance(first, RequestFinished) and isinstance(second, RequestFinished)
    assert first.record is not second.record
    record = {"request_id": "r1"}
    decoded = decode_event("RequestFinished", {"record": record})
    assert isinstance(decoded, RequestFinished) and decoded.record == record and decoded.record is not record


def test_a_record_reads_back_as_the_record_it_was() -> None:
    record = RequestRecord(
        request_id="r1",
        started_at_unix=T0,
        method="POST",
        path="/v1/chat/completions",
        api="chat",
        project="demo",
        session_id="s1",
        session_source="header:x-session-id",
        subagent=False,
        profile="iterative",
        stream=True,
        status=200,
        outcome="finished",
        error=None,
        timings=Timings(prompt_n=10, cache_n=5, predicted_n=40, predicted_ms=800.0, draft_n=30, draft_n_accepted=20),
        ttft_ms=12.5,
        ttst_ms=13.0,
        total_ms=900.0,
        route="estimate",
        reason="iterative: copyable 60%",
        handoff={"ok": True, "tokens": 4000, "save_s": 0.05, "restore_s": 0.01},
        new_tokens_est=12,
        replica=1,
        speculation={"types": ["ngram-mod"], "n_max": None, "set_by": "profile"},
    )
    assert decode_record(orjson.loads(orjson.dumps(record.to_json()))) == record


def test_a_record_of_another_version_reads_leniently() -> None:
    older = decode_record({"request_id": "r2", "profile": "oneshot", "status": "200", "timings": "n/a", "gpu": 1})
    assert (older.request_id, older.profile, older.status, older.timings, older.handoff) == (
        "r2",
        "oneshot",
        0,
        None,
        None,
    )
    assert older.outcome == "" and older.replica == 0 and older.ttft_ms is None
