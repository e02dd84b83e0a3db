"""Replica pools without a server: `choose_replica()` table-driven, `--profile` parsing, the upstream table's health
per replica and its events, the same-model check across a pool, and the router moving a session off an overloaded
replica with its KV through a slot mover."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from adaptive_spec.cli.serve import attached_profiles
from adaptive_spec.errors import ConfigError
from adaptive_spec.kv.effects import KvEffects
from adaptive_spec.kv.movers import MoveRequest, MoveTimes
from adaptive_spec.llama.profiles import ProfileInfo, replica_mismatch
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.routing.contract import Completion, Route, RouteRequest
from adaptive_spec.routing.replicas import MoveCosts, ReplicaState, choose_replica
from adaptive_spec.routing.router import Router
from adaptive_spec.telemetry.events import Event, ProfileDown, ProfileUp
from adaptive_spec.telemetry.records import Timings
from tests.support.routing import kv_effects, make_router, request, routed, served


def r(index: int, **kw: Any) -> ReplicaState:
    return ReplicaState(index=index, **{"slots": 2, **kw})


@pytest.mark.parametrize(
    ("replicas", "held_on", "costs", "expected"),
    [
        ([r(0)], None, None, (0, "only", None, False)),
        # New sessions: most free slots, then fewest in flight, then fewest sessions placed.
        ([r(0, busy_slots=1, in_flight=1), r(1)], None, None, (1, "least-loaded", None, False)),
        ([r(0, sessions=3), r(1, sessions=2)], None, None, (1, "least-loaded", None, False)),
        # Then the free slot no session used: the other's would evict a session's KV.
        (
            [r(0, sessions=1, unused_slots=0), r(1, sessions=1, unused_slots=1)],
            None,
            None,
            (1, "least-loaded", None, False),
        ),
        (
            [r(0, sessions=1, unused_slots=0), r(1, sessions=2, unused_slots=1)],
            None,
            None,
            (0, "least-loaded", None, False),
        ),
        ([r(0), r(1)], None, None, (0, "least-loaded", None, False)),
        ([r(0, down_reason="refused"), r(1, sessions=9)], None, None, (1, "least-loaded", None, False)),
        # A placed session stays on its KV cache, however loaded the others are not.
        ([r(0, busy_slots=1, in_flight=1), r(1)], 0, None, (0, "stay", None, False)),
        # Its replica is down: re-placed on the least loaded, re-prefilling.
        ([r(0), r(1, down_reason="refused"), r(2, in_flight=1, busy_slots=1)], 1, None, (0, "replaced", 1, False)),
        # Overloaded (every slot busy, 2 queued) beside an idle replica: moves when it costs less than the wait.
        (
            [r(0, busy_slots=2, in_flight=4), r(1)],
            0,
            MoveCosts(cached_tokens=5000, handoff_s=0.2, reprefill_s=12.0, wait_s=3.0),
            (1, "rebalanced", 0, True),
        ),
        (
            [r(0, busy_slots=2, in_flight=4), r(1)],
            0,
            MoveCosts(cached_tokens=5000, handoff_s=None, reprefill_s=12.0, wait_s=3.0),
            (0, "stay", None, False),
        ),
        (
            [r(0, busy_slots=2, in_flight=4), r(1)],
            0,
            MoveCosts(cached_tokens=500, handoff_s=None, reprefill_s=1.0, wait_s=3.0),
            (1, "rebalanced", 0, False),
        ),
        # Busy but nothing queued is not overloaded; nor is there a move when no replica is idle.
        ([r(0, busy_slots=2, in_flight=2), r(1)], 0, MoveCosts(handoff_s=0.1, wait_s=3.0), (0, "stay", None, False)),
        (
            [r(0, busy_slots=2, in_flight=4), r(1, busy_slots=2, in_flight=2)],
            0,
            MoveCosts(handoff_s=0.1, wait_s=3.0),
            (0, "stay", None, False),
        ),
    ],
)
def test_choose_replica(
    replicas: list[ReplicaState], held_on: int | None, costs: MoveCosts | None, expected: tuple[Any, ...]
) -> None:
    choice = choose_replica("plain", replicas, held_on, costs)
    assert (choice.replica, choice.kind, choice.moved_from, choice.handoff) == expected, choice.reason


def test_choose_replica_says_why() -> None:
    down = choose_replica("plain", [r(0), r(1, down_reason="refused connections")], 1)
    assert down.reason == "plain#0: replica #1 is down (refused connections); re-prefills"
    moved = choose_replica(
        "plain", [r(0, busy_slots=2, in_flight=3), r(1)], 0, MoveCosts(cached_tokens=4000, handoff_s=0.25, wait_s=2.0)
    )
    assert moved.reason == "plain#1: #0 overloaded (1 queued ≈ 2.0 s); hands its KV over (4,000 tok ≈ 0.25 s)"


def test_a_repeated_profile_name_makes_a_pool_in_order() -> None:
    attached = attached_profiles(["plain=http://a:1", "ngram=http://a:2", "plain=http://b:1/"])
    table = UpstreamTable([Upstream(a.name, a.base_url, a.upstream_model) for a in attached])
    assert table.names() == ["plain", "ngram"]
    assert [(u.base_url, u.replica, u.label) for u in table.replicas("plain")] == [
        ("http://a:1", 0, "plain"),
        ("http://b:1", 1, "plain#1"),
    ]
    with pytest.raises(ConfigError, match="--profile plain=http://a:1 is given twice"):
        attached_profiles(["plain=http://a:1", "plain=http://a:1/"])


def test_a_profile_is_down_only_when_every_replica_is() -> None:
    events: list[Event] = []
    table = UpstreamTable([Upstream("p", "http://a:1"), Upstream("p", "http://b:1")], publish=events.append)
    table.mark_down("p", "refused connections", 1, watch=True)
    assert table.down_reason("p") is None and table.replica_down_reason("p", 1) == "refused connections"
    assert table.watched == {("p", 1)}
    table.mark_down("p", "exited", 0)
    assert table.down_reason("p") == "#0 exited; #1 refused connections"
    table.mark_up("p", 1)
    assert table.watched == set() and table.down_reason("p") is None
    assert [(type(e), e.replica, getattr(e, "profile_down", None)) for e in events] == [  # type: ignore[union-attr]
        (ProfileDown, 1, False),
        (ProfileDown, 0, True),
        (ProfileUp, 1, None),
    ]


def _info(replica: int, model: str, url: str, spec: tuple[str, ...] = ("none",)) -> ProfileInfo:
    return ProfileInfo("plain", url, None, f"/models/{model}", "", 4096, 2, spec, False, replica)


def test_replicas_must_serve_the_same_model_and_setup() -> None:
    assert replica_mismatch([_info(0, "m.gguf", "http://a:1"), _info(1, "m.gguf", "http://b:1")]) is None
    message = replica_mismatch([_info(0, "m.gguf", "http://a:1"), _info(1, "n.gguf", "http://b:1")])
    assert message is not None and message.startswith(
        "the replicas of profile 'plain' serve different models: #0 at http://a:1 serves 'm.gguf' but #1 at "
        "http://b:1 serves 'n.gguf'"
    )
    spec = replica_mismatch([_info(0, "m.gguf", "http://a:1"), _info(1, "m.gguf", "http://b:1", ("ngram-mod",))])
    assert spec is not None and "different speculation types" in spec


class _FakeMover:
    def __init__(self) -> None:
        self.moves: list[tuple[str, int, str, int]] = []

    def can_move(self, source: Upstream, target: Upstream) -> bool:
        return True

    async def move(self, client: aiohttp.ClientSession, move: MoveRequest) -> MoveTimes:
        self.moves.append((move.source.label, move.from_slot, move.target.label, move.into_slot))
        return MoveTimes(4000, 0.05, 0.01)

    def transfers(self, source: Upstream, target: Upstream) -> bool:
        return False

    async def discard(self, name: str) -> None:
        return None


def _ask(sid: str, client_slot: int | None = None) -> RouteRequest:
    body = {"messages": [{"role": "user", "content": "x" * 400}]}
    return request(body, sid, turns=1, copy_share=0.0, body_bytes=400, client_slot=client_slot)


def _pool_router(
    mover: _FakeMover, slots: int, client: aiohttp.ClientSession | None = None
) -> tuple[Router, KvEffects]:
    """A pool of two replicas whose KV moves go through `mover`: the router, and its effects (the request path's
    mover too)."""
    table = UpstreamTable([Upstream("plain", "http://a:1"), Upstream("plain", "http://b:1")])
    effects = kv_effects(table, mover=mover, client=client)
    return make_router(table, {"plain": slots}, {"plain": ("none",)}, effects=effects), effects


def _served(router: Router, sid: str, slot: int | None, output: int = 10) -> None:
    """The session's turn, served on the first replica (both idle: the least loaded is the first)."""
    timings = Timings(prompt_n=4000 - output, predicted_n=output, predicted_ms=10.0 * output, prompt_ms=1000.0)
    done = served(router, _ask(sid, slot), timings)
    assert done.replica == 0


def test_a_session_queued_behind_others_moves_to_an_idle_replica_and_re_prefills() -> None:
    router, _ = _pool_router(_FakeMover(), slots=1)
    _served(router, "s", None, output=1000)  # long answers: a turn queued ahead takes longer than a re-prefill
    for other in ("x", "y"):  # replica 0's only slot busy with another session, one more queued behind it
        router.load.started("plain", None, other, 0)
    decision, _ = router.choose(_ask("s"))
    assert (decision.replica, decision.replica_kind, decision.replica_moved_from) == (1, "rebalanced", 0)
    assert not decision.handoff, decision.reason  # its slot is busy: nothing to save, it re-prefills
    assert "#0 overloaded (1 queued" in decision.reason and "re-prefills" in decision.reason
    assert decision.new_tokens is not None and decision.new_tokens >= 100


@pytest.mark.asyncio(loop_scope="function")
async def test_a_kv_handoff_between_replicas_goes_through_the_slot_mover() -> None:
    mover = _FakeMover()
    async with aiohttp.ClientSession() as client:
        router, effects = _pool_router(mover, slots=2, client=client)
        timings = Timings(prompt_n=3990, predicted_n=10, predicted_ms=100.0, prompt_ms=1000.0)
        first = await routed(router, _ask("s", 1))
        router.complete(first, Completion(True, timings))
        for other in ("x", "y", "z"):  # the other slot busy, two queued for it; the session's own slot 1 is idle
            router.load.started("plain", 0, other, 0)
        moved = await routed(router, _ask("s", 0), effects)
    decision = moved.decision
    assert (decision.replica, decision.replica_kind, decision.handoff) == (1, "rebalanced", True), decision.reason
    assert decision.handoff_tokens == 4000 and "hands its KV over (4,000 tok" in decision.reason
    assert moved.handoff is not None and moved.handoff.ok and mover.moves == [("plain", 1, "plain#1", 0)]
    placement = router.placements.get("s")
    assert placement is not None and placement.in_slot


def test_a_session_leaving_a_replica_that_is_down_re_prefills_on_the_new_profile(tmp_path: Path) -> None:
    table = UpstreamTable(
        [Upstream("oneshot", "http://a:1"), Upstream("oneshot", "http://b:1"), Upstream("iterative", "http://a:2")]
    )
    effects = kv_effects(table, slot_dir=tmp_path)
    router = make_router(table, {"oneshot": 1, "iterative": 1}, {"oneshot": ("none",)}, effects=effects)
    router.placements.served("s", "oneshot", None, 4000, 10, replica=1)
    body = {"messages": [{"role": "user", "content": "word " * 8000}]}  # more than the 4,000 tokens its KV holds
    moving = request(body, "s", pinned="iterative", turns=3, copy_share=0.0, body_bytes=40_000)
    up, _ = router.choose(moving)
    assert up.handoff and up.moved_from == "oneshot", up.reason
    table.mark_down("oneshot", "refused connections", 1)
    down, _ = router.choose(moving)
    assert down.moved_from == "oneshot" and not down.handoff and down.handoff_tokens == 0


def test_a_session_this_proxy_has_in_flight_is_not_counted_as_another_proxys() -> None:
    """The shared state names the slot's occupant from the booking, before the turn ends and the router places the
    session: a lone proxy reading its own in-flight session there counts it as its own, not as one more session on
    that server. Counted twice, a new session tied the replicas and took the free slot of a session served a moment
    ago (its next turn re-prefilled) instead of the other replica's stale one."""
    router, _ = _pool_router(_FakeMover(), slots=2)
    timings = Timings(prompt_n=3990, predicted_n=10, predicted_ms=100.0, prompt_ms=1000.0)
    earlier = [router.route(_ask(f"old{i}")) for i in range(4)]  # every slot used once, two sessions on each
    for route in earlier:
        assert isinstance(route, Route)
        router.complete(route, Completion(True, timings, ""))
    _served(router, "a", None)  # replica 0: a, done (three sessions placed there, two on replica 1)
    b = router.route(_ask("b"))  # replica 1: fewer sessions
    c = router.route(_ask("c"))  # replica 0: more free slots
    assert isinstance(b, Route) and isinstance(c, Route) and (b.replica, c.replica) == (1, 0)
    # Read after b's booking, before c's: b occupies its slot on replica 1.
    router.adopt("d", None, {}, {router.server_url("plain", 1): {b.slot or 0: "b"}})
    d = router.route(_ask("d"))
    assert isinstance(d, Route) and d.replica == 1, d.decision  # replica 0's free slot holds a's KV
    placed = router.placements.get("a")
    assert placed is not None and placed.in_slot
