"""The router's bookkeeping without a server: load and slots come down on every path, sessions keep their slot."""

from __future__ import annotations

from pathlib import Path

from adaptive_spec.core.records import Timings
from adaptive_spec.core.routing.router import FixedPolicy
from adaptive_spec.proxy.routing import Router
from adaptive_spec.proxy.upstreams import Upstream, UpstreamTable


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
