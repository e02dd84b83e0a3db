"""Two profiles as per-request settings of one llama-server: they share its slots, its load and its sessions' KV, and a
switch between them is not a move (priced 0, no handoff, no dwell, "same server"); the same pair on two servers
still moves the KV. Pure: decide() and the router's bookkeeping, no server."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from adaptive_spec.llama.speculation import Speculation
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.policy.model import Policy
from adaptive_spec.routing.decide import decide
from adaptive_spec.routing.decision import Choice, Decision, compose
from adaptive_spec.routing.estimate import ProfileState, RequestState, SessionState
from adaptive_spec.routing.placements import Placement
from adaptive_spec.routing.router import Router
from adaptive_spec.routing.speeds import SpeedModel
from adaptive_spec.telemetry.records import Timings
from tests.support.routing import kv_effects, make_router, request, served

KINDS = {"oneshot": ("none",), "iterative": ("ngram-mod",)}
URL = "http://127.0.0.1:9"
SHARED = {("oneshot", 0): URL, ("iterative", 0): URL}


def _speeds() -> SpeedModel:
    return SpeedModel(Policy().estimator, Policy().handoff, KINDS)


@pytest.mark.parametrize(
    ("same_server", "turns_here", "kind", "handoff", "reason"),
    [
        # One server: the switch keeps the KV (only the new tokens are prefilled), needs no dwell, moves nothing.
        (frozenset({"iterative"}), 1, "estimate", False, "same server as oneshot: keeps its KV cache, no handoff"),
        (frozenset({"iterative"}), 3, "estimate", False, "same server as oneshot: keeps its KV cache, no handoff"),
        # Two servers: the dwell holds it first, then it moves with a slot save + restore.
        (frozenset(), 1, "stay", False, "turn 1 of a 2-turn dwell"),
        (frozenset(), 3, "estimate", True, "hands its KV over from oneshot"),
    ],
)
def test_a_switch_on_one_server_costs_nothing(
    same_server: frozenset[str], turns_here: int, kind: str, handoff: bool, reason: str
) -> None:
    session = SessionState("s", 4, 0.9, Placement("oneshot", 0, 6000, turns_here, 300), same_server=same_server)
    profiles = [ProfileState(n, handoff=True) for n in KINDS]
    decision = decide(RequestState(int(6500 * 3.5)), session, profiles, _speeds(), Policy())
    assert (decision.kind, decision.handoff) == (kind, handoff), decision.reason
    assert reason in decision.reason
    estimate = {e.profile: e for e in decision.estimates}["iterative"]
    if same_server:
        assert decision.profile == "iterative" and decision.moved_from == "oneshot"
        assert estimate.handoff_s == 0 and estimate.prefill_tokens == 500  # only what the KV does not hold


def test_a_pinned_switch_on_one_server_says_so() -> None:
    session = SessionState("s", 4, 0.0, Placement("oneshot", 0, 6000, 1, 300), same_server=frozenset({"iterative"}))
    request = RequestState(int(6500 * 3.5), pinned="iterative")
    decision = decide(request, session, [ProfileState(n, handoff=True) for n in KINDS], _speeds(), Policy())
    assert (decision.kind, decision.handoff, decision.handoff_tokens) == ("pinned", False, 0)
    assert decision.reason == (
        "iterative: pinned by the request header; same server as oneshot: keeps its KV cache, no handoff"
    )


def _router(tmp_path: Path, slots: int = 1, servers: dict[tuple[str, int], str] | None = SHARED) -> Router:
    table = UpstreamTable([Upstream("oneshot", URL, speculation=Speculation(types=())), Upstream("iterative", URL)])
    return make_router(
        table, dict.fromkeys(KINDS, slots), KINDS, effects=kv_effects(table, slot_dir=tmp_path), servers=servers
    )


def _served(r: Router, profile: str, session: str) -> Decision:
    body = {"messages": [{"role": "user", "content": f"{session} " * 50}]}
    timings = Timings(prompt_n=2000, predicted_n=100, predicted_ms=500.0)
    return served(r, request(body, session, pinned=profile, body_bytes=300), timings).decision


def test_profiles_on_one_server_share_its_slots_and_load(tmp_path: Path) -> None:
    r = _router(tmp_path, slots=2)
    a = r.load.slot_for("oneshot", "a")
    r.load.started("oneshot", a, "a")
    b = r.load.slot_for("iterative", "b")
    assert b != a  # a's slot is busy serving oneshot: iterative's request on the same server gets the other one
    assert r.load.slot_busy("iterative", a, mine=0)
    assert {s.name: s.in_flight for s in r.states()} == {"oneshot": 1, "iterative": 1}  # the server's load, both
    one = _router(tmp_path, slots=1)
    one.load.started("oneshot", None, "a")
    assert one.load.slot_busy("iterative", None, mine=0)  # the server's only slot
    apart = _router(tmp_path, slots=1, servers=None)
    apart.load.started("oneshot", None, "a")
    assert not apart.load.slot_busy("iterative", None, mine=0)


def test_a_session_keeps_its_slot_across_a_switch_and_nothing_moves(tmp_path: Path) -> None:
    r = _router(tmp_path, slots=2)
    first = _served(r, "oneshot", "a")
    placement = r.placements.get("a")
    assert first.moved_from is None and placement is not None and placement.in_slot
    assert r.load.slot_for("iterative", "a") == placement.slot  # its slot, under the other profile
    second = _served(r, "iterative", "a")
    assert (second.moved_from, second.handoff, second.replica_kind) == ("oneshot", False, "only")
    assert "same server" in second.reason
    moved = r.placements.get("a")
    assert moved is not None and (moved.profile, moved.slot, moved.in_slot) == ("iterative", placement.slot, True)
    assert r.planner.handoffs == {"ok": 0, "failed": 0}


def test_another_profiles_request_in_the_slot_displaces_the_session(tmp_path: Path) -> None:
    r = _router(tmp_path, slots=1)
    _served(r, "oneshot", "a")
    _served(r, "iterative", "b")  # the server's one slot now holds b
    a = r.placements.get("a")
    assert a is not None and not a.in_slot
    apart = _router(tmp_path, slots=1, servers=None)
    _served(apart, "oneshot", "a")
    _served(apart, "iterative", "b")
    a = apart.placements.get("a")
    assert a is not None and a.in_slot  # another server's slot: a's is untouched


def test_erasing_one_profile_empties_the_server_for_both(tmp_path: Path) -> None:
    r = _router(tmp_path, slots=1)
    _served(r, "iterative", "a")
    r.slots_erased("oneshot", 0)
    a = r.placements.get("a")
    assert a is not None and not a.in_slot
    assert replace(a, in_slot=True).profile == "iterative"


def test_a_pair_whose_handoffs_reused_nothing_re_prefills() -> None:
    """llama.cpp #26676 and hybrid targets: a restore reports success and the next prompt still re-prefills from 0.
    Once measured, the router stops paying for handoffs between that pair; other pairs keep theirs."""
    session = SessionState("s", 4, 0.9, Placement("oneshot", 0, 1500, 3, 800))
    profiles = [ProfileState(n, handoff=True) for n in KINDS]
    request = RequestState(int(1600 * 3.5))
    assert decide(request, session, profiles, _speeds(), Policy()).handoff  # unmeasured: a handoff is worth it
    measured = replace(session, handoff_reuse={"iterative": (1 / 3, 1)})
    decision = decide(request, measured, profiles, _speeds(), Policy())
    assert (decision.profile, decision.handoff) == ("iterative", False), decision.reason
    assert "handoffs from oneshot reused 33% of what they restored, 1 measured: none made" in decision.reason
    # A pair whose handoffs reused most of what they restored keeps handing over.
    fine = replace(session, handoff_reuse={"iterative": (0.98, 3)})
    assert decide(request, fine, profiles, _speeds(), Policy()).handoff


def test_the_router_learns_what_a_handoff_reused_from_the_next_prompts_cache_n() -> None:
    from adaptive_spec.kv.moves import HandoffResult
    from adaptive_spec.routing.contract import Completion, Route

    table = UpstreamTable([Upstream("oneshot", "http://127.0.0.1:1"), Upstream("iterative", "http://127.0.0.1:2")])
    router = make_router(table, {"oneshot": 1, "iterative": 1}, KINDS)
    decision = compose(Choice("iterative", "pinned", ("pinned",), 0.9, 6000, moved_from="oneshot", handoff=True))
    restored = HandoffResult(True, 6000, 0.2, 0.02)
    for cache_n in (0, 5990):
        route = Route(decision, None, f"s{cache_n}", 20000, handoff=restored)
        router.complete(route, Completion(ok=True, timings=Timings(prompt_n=6400, cache_n=cache_n, predicted_n=8)))
        if cache_n == 0:
            reuse = router.planner.reuse_from("oneshot")["iterative"]
            share, count = reuse
            assert share == pytest.approx(1 / 3) and count == 1  # the prior (1, worth half a handoff) and one 0
    after = router.planner.reuse
    assert list(after) == [("oneshot", "iterative")]
    measured = after[("oneshot", "iterative")]
    assert measured.value(1.0) == pytest.approx(0.6, abs=0.01) and measured.n == pytest.approx(2.0, abs=0.02)
