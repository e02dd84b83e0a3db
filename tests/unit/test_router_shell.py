"""The router's bookkeeping without a server: load and slots come down on every path, sessions keep their slot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adaptive_spec.kv.handoff import Router
from adaptive_spec.routing.decide import Decision
from adaptive_spec.routing.router import FixedPolicy
from adaptive_spec.servers.upstreams import Upstream, UpstreamTable
from adaptive_spec.telemetry.records import Timings


def router(slots: int = 2, slot_dir: Path | None = None) -> Router:
    table = UpstreamTable([Upstream("oneshot", "http://127.0.0.1:9"), Upstream("iterative", "http://127.0.0.1:9")])
    return Router(
        table,
        FixedPolicy(),
        {"oneshot": slots, "iterative": slots},
        {"oneshot": ("none",), "iterative": ("ngram-mod",)},
        slot_dir=slot_dir,
    )


def test_a_session_keeps_its_slot_and_a_busy_slot_is_not_shared() -> None:
    r = router()
    a = r.slot_for("iterative", "a")
    r.started("iterative", a)
    b = r.slot_for("iterative", "b")
    assert a != b  # a's slot is busy: b gets the other
    r.started("iterative", b)
    decision, _ = r.choose(
        body={"messages": []},
        body_bytes=10,
        session_id="a",
        session_turns=0,
        copy_share=None,
        project="default",
        workspace=None,
        pinned=None,
    )
    r.finished(decision, "iterative", a, "a", Timings(prompt_n=10, predicted_n=20, predicted_ms=100.0), 10, True)
    r.finished(decision, "iterative", b, "b", None, 10, False)
    assert r.in_flight["iterative"] == 0
    assert r.slot_for("iterative", "a") == a  # back on its own slot, now idle
    placement = r.placements.get("a")
    assert placement is not None and placement.slot == a and placement.cached_tokens == 30


def test_serving_another_session_in_a_slot_displaces_the_one_it_held() -> None:
    r = router(slots=1)
    decision, _ = r.choose(
        body={"messages": []},
        body_bytes=10,
        session_id="a",
        session_turns=0,
        copy_share=None,
        project="default",
        workspace=None,
        pinned=None,
    )
    for sid in ("a", "b"):
        r.started("oneshot", None)
        r.finished(decision, "oneshot", None, sid, Timings(prompt_n=10, predicted_n=20, predicted_ms=100.0), 10, True)
    a, b = r.placements.get("a"), r.placements.get("b")
    assert a is not None and not a.in_slot and b is not None and b.in_slot


def test_handoffs_need_a_slot_directory_and_no_router_preset(tmp_path: Path) -> None:
    assert not any(s.handoff for s in router(slot_dir=None).states())
    assert all(s.handoff for s in router(slot_dir=tmp_path).states())
    table = UpstreamTable([Upstream("a", "http://h:1", "preset-a"), Upstream("b", "http://h:1", "preset-b")])
    preset = Router(table, FixedPolicy(), {}, {}, slot_dir=tmp_path)
    assert not any(s.handoff for s in preset.states())


def test_stale_slot_files_are_swept(tmp_path: Path) -> None:
    import os
    import time

    r = router(slot_dir=tmp_path)
    old, fresh, other = tmp_path / "as-old-1.bin", tmp_path / "as-new-2.bin", tmp_path / "user.bin"
    for path in (old, fresh, other):
        path.write_bytes(b"x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    os.utime(other, (time.time() - 3600, time.time() - 3600))
    assert r.sweep_slot_files() == 1
    assert not old.exists() and fresh.exists() and other.exists()


def _choose(r: Router, body: dict[str, Any], session: str) -> Decision:
    decision, _ = r.choose(
        body=body,
        body_bytes=len(str(body)),
        session_id=session,
        session_turns=0,
        copy_share=None,
        project="default",
        workspace=None,
        pinned=None,
    )
    return decision


def test_new_tokens_come_from_what_the_slot_holds_and_a_busy_session_is_not_new() -> None:
    r = router(slots=1)
    system = {"role": "system", "content": "You are a careful coding agent. " * 200}
    first = {"messages": [system, {"role": "user", "content": "task one"}]}
    d1 = _choose(r, first, "a")
    r.started(d1.profile, None, "a")
    d_side = _choose(r, {"messages": [{"role": "user", "content": "a title please"}]}, "a")
    assert "new session" not in d_side.reason and "still in flight" in d_side.reason
    timings = Timings(prompt_n=1500, cache_n=0, predicted_n=40, predicted_ms=800.0, prompt_ms=3000.0)
    r.finished(d1, d1.profile, None, "a", timings, 100, True, "the answer")
    assert d1.new_tokens is not None and d1.new_tokens > 1000
    # Another session of the same agent: the slot holds the shared system prompt, so only its own turn is new.
    d2 = _choose(r, {"messages": [system, {"role": "user", "content": "task two"}]}, "b")
    assert d2.profile == d1.profile and d2.new_tokens is not None and d2.new_tokens < 30
    # The first session's next turn carries the reply back: only what follows it is new.
    follow = {
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": "the answer"},
            {"role": "user", "content": "go on"},
        ]
    }
    d3 = _choose(r, follow, "a")
    assert d3.new_tokens is not None and d3.new_tokens < 30


def test_a_main_line_that_starts_while_the_title_is_in_flight_is_known_at_its_end() -> None:
    """opencode sends its title request and its first turn at once: the line moves when the first turn ends."""
    r = router(slots=1)
    title = {"messages": [{"role": "system", "content": "Write a title."}, {"role": "user", "content": "fix it"}]}
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    main = {"messages": [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "fix it"}]}
    d_title = _choose(r, title, "s")
    d_main = _choose(r, {**main, "tools": tools}, "s")
    t = Timings(prompt_n=100, predicted_n=5, predicted_ms=50.0)
    assert not r.finished(d_title, d_title.profile, None, "s", t, 10, True, "A title")
    assert r.finished(d_main, d_main.profile, None, "s", t, 10, True, "done")
