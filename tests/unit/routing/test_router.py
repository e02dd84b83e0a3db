"""The router's bookkeeping without a server, driven through `route()` and `complete()` as the proxy drives it: load
and slots come down on every path, sessions keep their slot."""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from pathlib import Path
from typing import Any

import pytest

from adaptive_spec.kv.effects import KvEffects
from adaptive_spec.kv.moves import HandoffResult, PrefillAsk, RemotePrefillResult, SlotAt, SlotMove
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.requests.carry_out import carry_out
from adaptive_spec.routing.contract import Completion, Effects, FixedPolicy, NoEffects, Route
from adaptive_spec.routing.placements import observe
from adaptive_spec.routing.router import Router
from adaptive_spec.telemetry.records import Timings
from tests.support.routing import kv_effects, make_router, request, route, served

TIMINGS = Timings(prompt_n=10, predicted_n=20, predicted_ms=100.0)


def router(slots: int = 2, slot_dir: Path | None = None) -> Router:
    table = UpstreamTable([Upstream("oneshot", "http://127.0.0.1:9"), Upstream("iterative", "http://127.0.0.1:9")])
    kinds = {"oneshot": ("none",), "iterative": ("ngram-mod",)}
    return make_router(
        table, {"oneshot": slots, "iterative": slots}, kinds, effects=kv_effects(table, slot_dir=slot_dir)
    )


def test_a_session_keeps_its_slot_and_a_busy_slot_is_not_shared() -> None:
    r = router()
    body: dict[str, Any] = {"messages": []}
    a = route(r, request(body, "a", pinned="iterative"))
    b = route(r, request(body, "b", pinned="iterative"))
    assert a.slot is not None and b.slot is not None and a.slot != b.slot  # a's slot is busy: b gets the other
    assert r.load.in_flight["iterative"] == 2
    r.complete(a, Completion(True, TIMINGS))
    r.complete(b, Completion(False))
    assert r.load.in_flight["iterative"] == 0
    assert r.load.slot_for("iterative", "a") == a.slot  # back on its own slot, now idle
    placement = r.placements.get("a")
    assert placement is not None and placement.slot == a.slot and placement.cached_tokens == 30


def test_an_api_that_takes_no_slot_is_not_given_one_and_a_client_slot_is_followed() -> None:
    r = router()
    assert route(r, request({"messages": []}, "a", takes_slot=False)).slot is None
    assert route(r, request({"messages": []}, "b", client_slot=1)).slot == 1


def test_serving_another_session_in_a_slot_displaces_the_one_it_held() -> None:
    r = router(slots=1)
    for sid in ("a", "b"):
        served(r, request({"messages": []}, sid, pinned="oneshot"), TIMINGS)
    a, b = r.placements.get("a"), r.placements.get("b")
    assert a is not None and not a.in_slot and b is not None and b.in_slot


def test_handoffs_need_a_slot_directory_and_no_router_preset(tmp_path: Path) -> None:
    assert not any(s.handoff for s in router(slot_dir=None).states())
    assert all(s.handoff for s in router(slot_dir=tmp_path).states())
    table = UpstreamTable([Upstream("a", "http://h:1", "preset-a"), Upstream("b", "http://h:1", "preset-b")])
    preset = make_router(table, {}, {}, effects=kv_effects(table, slot_dir=tmp_path))
    assert not any(s.handoff for s in preset.states())


def test_stale_slot_files_are_swept(tmp_path: Path) -> None:
    table = UpstreamTable([Upstream("oneshot", "http://127.0.0.1:9")])
    effects = KvEffects(table, lambda: NotImplemented, slot_dir=tmp_path)
    old, fresh, other = tmp_path / "as-old-1.bin", tmp_path / "as-new-2.bin", tmp_path / "user.bin"
    for path in (old, fresh, other):
        path.write_bytes(b"x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    os.utime(other, (time.time() - 3600, time.time() - 3600))
    assert effects.sweep() == 1
    assert not old.exists() and fresh.exists() and other.exists()


def test_new_tokens_come_from_what_the_slot_holds_and_a_busy_session_is_not_new() -> None:
    r = router(slots=1)
    system = {"role": "system", "content": "You are a careful coding agent. " * 200}
    first = {"messages": [system, {"role": "user", "content": "task one"}]}
    r1 = route(r, request(first, "a"))
    d_side = r.choose(request({"messages": [{"role": "user", "content": "a title please"}]}, "a"))[0]
    assert "new session" not in d_side.reason and "still in flight" in d_side.reason
    timings = Timings(prompt_n=1500, cache_n=0, predicted_n=40, predicted_ms=800.0, prompt_ms=3000.0)
    r.complete(r1, Completion(True, timings, "the answer"))
    assert r1.decision.new_tokens is not None and r1.decision.new_tokens > 1000
    # Another session of the same agent: the slot holds the shared system prompt, so only its own turn is new.
    d2 = r.choose(request({"messages": [system, {"role": "user", "content": "task two"}]}, "b"))[0]
    assert d2.profile == r1.profile and d2.new_tokens is not None and d2.new_tokens < 30
    # The first session's next turn carries the reply back: only what follows it is new.
    follow = {
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": "the answer"},
            {"role": "user", "content": "go on"},
        ]
    }
    d3 = r.choose(request(follow, "a"))[0]
    assert d3.new_tokens is not None and d3.new_tokens < 30


def test_a_main_line_that_starts_while_the_title_is_in_flight_is_known_at_its_end() -> None:
    """opencode sends its title request and its first turn at once: the line moves when the first turn ends."""
    r = router(slots=1)
    title = {"messages": [{"role": "system", "content": "Write a title."}, {"role": "user", "content": "fix it"}]}
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    main = {"messages": [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "fix it"}]}
    r_title: Route = route(r, request(title, "s", body_bytes=10))
    r_main: Route = route(r, request({**main, "tools": tools}, "s", body_bytes=10))
    t = Timings(prompt_n=100, predicted_n=5, predicted_ms=50.0)
    assert not r.complete(r_title, Completion(True, t, "A title"))
    assert r.complete(r_main, Completion(True, t, "done"))


def test_a_request_cancelled_during_its_kv_move_leaves_no_load_behind() -> None:
    """The client hangs up while its session's slot is being moved: the request path completes the route itself
    (the forward never gets it)."""

    class _Movable(NoEffects):
        def can_move(self, source: SlotAt, target: SlotAt) -> bool:
            return True

    class _Hangs:
        async def move_slot(self, move: SlotMove) -> HandoffResult:
            raise asyncio.CancelledError

        async def prefill_elsewhere(self, ask: PrefillAsk) -> RemotePrefillResult | None:
            raise AssertionError("no remote prefill here")

    table = UpstreamTable([Upstream("oneshot", "http://127.0.0.1:9"), Upstream("iterative", "http://127.0.0.1:8")])
    r = Router(table, FixedPolicy(), {"oneshot": 1, "iterative": 1}, {"iterative": ("ngram-mod",)}, _Movable())
    r.placements.served("s", "oneshot", None, 4000, 10)
    body = {"messages": [{"role": "user", "content": "word " * 8000}]}
    ask = request(body, "s", pinned="iterative", turns=3, copy_share=0.0, body_bytes=40_000)
    assert r.choose(ask)[0].handoff
    with pytest.raises(asyncio.CancelledError):
        route(r, ask, _Hangs())
    assert r.load.in_flight == {"oneshot": 0, "iterative": 0}
    assert r.load.server_busy("iterative") == 0 and r.load.sessions_in_flight == {}


class _Recording(NoEffects):
    """The router's effects and the request path's mover as a recording: which moves were asked of the world, and
    what it was told."""

    def __init__(self, result: HandoffResult) -> None:
        self.result, self.moves, self.events = result, list[SlotMove](), list[Any]()

    def can_move(self, source: SlotAt, target: SlotAt) -> bool:
        return True

    async def move_slot(self, move: SlotMove) -> HandoffResult:
        self.moves.append(move)
        return self.result

    async def prefill_elsewhere(self, ask: PrefillAsk) -> RemotePrefillResult | None:
        raise AssertionError("no remote prefill here")

    def publish(self, event: Any) -> None:
        self.events.append(event)


def _moving_router(effects: _Recording) -> tuple[Router, Any]:
    table = UpstreamTable([Upstream("oneshot", "http://127.0.0.1:9"), Upstream("iterative", "http://127.0.0.1:8")])
    r = Router(table, FixedPolicy(), {"oneshot": 1, "iterative": 1}, {"iterative": ("ngram-mod",)}, effects)
    r.placements.served("s", "oneshot", None, 4000, 10)
    body = {"messages": [{"role": "user", "content": "word " * 8000}]}
    return r, request(body, "s", pinned="iterative", turns=3, copy_share=0.0, body_bytes=40_000)


def test_route_asks_for_the_move_and_waits_for_nothing() -> None:
    """route() is synchronous: it names the slot move and touches no effect; the request path carries the move out
    and reports it with moved(), which learns from it (the counters, the event, the target slot's placement)."""
    effects = _Recording(HandoffResult(True, 4000, 0.2, 0.01))
    r, ask = _moving_router(effects)
    planned = r.route(ask)
    assert isinstance(planned, Route)
    assert planned.move == SlotMove("s", SlotAt("oneshot", 0, None), SlotAt("iterative", 0, None), 4000)
    assert planned.handoff is None and effects.moves == [] and effects.events == []
    done = asyncio.run(carry_out(r, effects, planned))  # as the request path does
    assert effects.moves == [planned.move] and done.handoff == effects.result
    assert r.planner.handoffs == {"ok": 1, "failed": 0}
    (event,) = [e for e in effects.events if type(e).__name__ == "HandoffDone"]
    assert (event.from_profile, event.to_profile, event.ok, event.tokens) == ("oneshot", "iterative", True, 4000)


def test_a_handoff_that_cannot_be_made_asks_for_no_move() -> None:
    """The session's slot is busy with another request: the route carries the refusal, and nothing is asked."""
    effects = _Recording(HandoffResult(True, 4000, 0.2, 0.01))
    r, ask = _moving_router(effects)
    r.load.started("oneshot", None, "other", 0)  # another session's request now runs in the source slot
    done = route(r, ask, effects)
    assert done.move is None and effects.moves == []
    assert (
        done.handoff is not None and not done.handoff.ok and "busy with another request" in (done.handoff.error or "")
    )
    assert r.planner.handoffs == {"ok": 0, "failed": 1}


def test_the_router_and_its_move_planner_never_wait() -> None:
    """llama-swap's scheduler rule: slow work leaves as an effect. No method of the router, of its KV move planner or
    of the effects it may call is a coroutine; the request path awaits its mover (`carry_out`) and reports back."""
    from adaptive_spec.routing.move_planner import MovePlanner

    for cls in (Router, MovePlanner, Effects, NoEffects):
        waiting = [n for n, f in vars(cls).items() if inspect.iscoroutinefunction(f)]
        assert waiting == [], f"{cls.__name__} awaits in {waiting}"


def test_a_side_request_in_a_slot_of_its_own_displaces_whoever_held_that_slot() -> None:
    """A title request served in slot 1 without its session (a side request keeps the session's own slot) overwrote
    slot 1: the session that held it there is no longer counted as in it."""
    r = router(slots=2)
    served(r, request({"messages": []}, "a", pinned="oneshot", client_slot=1), TIMINGS)
    held = r.placements.get("a")
    assert held is not None and held.in_slot and held.slot == 1
    observe(r.speeds, r.placements, "oneshot", 1, None, 0.0, TIMINGS, 10)
    after = r.placements.get("a")
    assert after is not None and not after.in_slot
