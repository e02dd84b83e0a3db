from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from adaptive_spec.bench.runner import BUILTIN, load_workload
from adaptive_spec.bench.workload import FORMAT, Replay, WorkloadError, parse_workload, workload_from_trace


def _w(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "format": FORMAT,
        "name": "t",
        "sessions": {"s": {"system": "sys"}},
        "requests": [
            {"session": "s", "user": "one", "max_tokens": 10},
            {"session": "s", "user": "two", "max_tokens": 5},
        ],
    }
    return {**base, **overrides}


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_workloads_load(name: str) -> None:
    workload = load_workload(name)
    assert (
        workload.name == name
        and len(workload.requests) >= {"iterative": 8, "oneshot": 20, "mixed": 10, "prose": 8}[name]
    )


def test_builtin_shapes() -> None:
    iterative = load_workload("iterative")
    assert len({r.session for r in iterative.requests}) == 1
    assert all("complete updated file" in (r.user or "") for r in iterative.requests)
    oneshot = load_workload("oneshot")
    assert len({r.session for r in oneshot.requests}) == len(oneshot.requests)
    mixed = load_workload("mixed")
    sessions = [r.session for r in mixed.requests]
    assert sessions.count("inventory") >= 3 and sessions.count("todo") >= 3 and any(s.startswith("q") for s in sessions)


def test_replay_keeps_history_and_tags_the_system_prompt() -> None:
    workload = parse_workload(_w(), "t.json")
    replay = Replay(workload, tag="pass A")
    first = replay.messages_for(workload.requests[0])
    assert first == [{"role": "system", "content": "[pass A] sys"}, {"role": "user", "content": "one"}]
    replay.keep_reply(workload.requests[0], "reply one")
    second = replay.messages_for(workload.requests[1])
    assert [m["content"] for m in second] == ["[pass A] sys", "one", "reply one", "two"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"format": "other/1"}, "t.json: format: expected 'adaptive-spec-workload/1'"),
        ({"requests": []}, "t.json: requests: the workload has none"),
        (
            {"requests": [{"session": "s", "user": "x", "max_tokens": "9"}]},
            "t.json: requests[0].max_tokens: expected int",
        ),
        ({"requests": [{"session": "s", "max_tokens": 9}]}, "requests[0]: give exactly one of 'user' or 'messages'"),
        ({"requests": [{"session": "nope", "user": "x", "max_tokens": 9}]}, "requests[0].session: 'nope' is not in"),
    ],
)
def test_bad_workloads_name_file_and_key(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(WorkloadError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        parse_workload(_w(**overrides), "t.json")


def test_bench_reads_a_trace_file_as_a_workload(tmp_path: Path) -> None:
    trace = tmp_path / "day.jsonl"
    lines = [
        {"kind": "profiles", "profiles": []},
        {
            "kind": "request",
            "session_id": "s1",
            "request_body": {"messages": [{"role": "user", "content": "a"}]},
            "timings": {"predicted_n": 33},
        },
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    workload = load_workload(str(trace))
    assert workload.name == "day" and workload.requests[0].max_tokens == 33


def test_trace_converts_into_a_workload() -> None:
    lines: list[dict[str, Any]] = [
        {"kind": "profiles", "profiles": []},
        {
            "kind": "request",
            "session_id": "ses",
            "request_body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12},
        },
        {"kind": "request", "session_id": "ses"},  # recorded without --trace-content: skipped
    ]
    converted = workload_from_trace(lines, "mine")
    workload = parse_workload(converted, "converted")
    assert len(workload.requests) == 1 and workload.requests[0].max_tokens == 12
    assert Replay(workload).messages_for(workload.requests[0]) == [{"role": "user", "content": "hi"}]
    with pytest.raises(WorkloadError, match="--trace-content"):
        workload_from_trace(lines[:1], "empty")
