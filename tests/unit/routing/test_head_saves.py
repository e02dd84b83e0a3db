"""A head save is the router's decision like a restore: `plan_save` decides it where a request completes, from the
route's pieces, llama-server's timings, the resolved heads policy and what the store's tables showed of the request
(`TurnShown`), and names the `HeadSave` the store carries out."""

from __future__ import annotations

from dataclasses import replace

import pytest

from adaptive_spec.kv.heads.activity import TurnMark
from adaptive_spec.kv.heads.values import Restored, TurnShown
from adaptive_spec.kv.moves import AfterTurn, HeadSave, SlotAt
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.policy.model import HeadsPolicy
from adaptive_spec.routing.contract import Completion, Route, TurnEnd
from adaptive_spec.routing.move_planner import plan_save
from adaptive_spec.routing.prompt.pieces import Piece
from adaptive_spec.routing.router import Router
from adaptive_spec.telemetry.records import Timings
from tests.support.routing import make_router, request

URL = "http://127.0.0.1:9"
SYSTEM, USER, REPLY = Piece(b"s" * 16, 3000), Piece(b"u" * 16, 100), Piece(b"r" * 16, 80, assistant=True)
BLOCKS = ((b"block-1",), (b"block-2",))
OWNER = ("opencode", "default", "")
MARK = TurnMark((3, 1))


def _route(side: bool = False, pieces: tuple[Piece, ...] = (SYSTEM, USER), session: str | None = "s") -> Route:
    """A route of the router's own making, with the pieces and side-ness a case needs."""
    r: Router = make_router(UpstreamTable([Upstream("p", URL)]), {"p": 2}, {"p": ("none",)})
    route = r.route(request({"messages": [{"role": "user", "content": "hi"}]}, "s", client_slot=1))
    assert isinstance(route, Route), route
    r.complete(route, Completion(ok=False))
    decision = replace(route.decision, side=side)
    return replace(route, decision=decision, pieces=pieces, session_id=session)


def _end(
    first: bool = True,
    status: int = 200,
    prompt_n: int = 1000,
    cache_n: int = 0,
    policy: HeadsPolicy | None = None,
    restored: Restored | None = None,
    from_usage: bool = False,
    preset: bool = False,
) -> TurnEnd:
    timings = Timings(prompt_n=prompt_n, cache_n=cache_n, predicted_n=8, from_usage=from_usage)
    shown = TurnShown(first, restored, MARK)
    return TurnEnd(status, timings, policy or HeadsPolicy(), shown, URL, preset, OWNER, blocks=lambda: BLOCKS)


def _save(route: Route, end: TurnEnd) -> HeadSave | None:
    after = plan_save(route, end)
    return after.save if after is not None else None


def test_a_sessions_first_turn_is_saved_as_a_head_at_once() -> None:
    save = _save(_route(), _end())
    assert save is not None and save.idle_s == 0.0, save
    assert save.at == SlotAt("p", 0, 1) and save.server == URL and save.mark == MARK
    turn = save.turn
    assert turn.pieces == (SYSTEM.digest, USER.digest) and turn.chars == (3000, 100) and turn.session == ""
    assert (turn.prompt_tokens, turn.reply_tokens) == (1000, 8) and (turn.agent, turn.project, turn.scope) == OWNER
    assert turn.blocks == BLOCKS  # a head's blocks are kept with it


def test_a_first_turn_below_the_policys_min_tokens_is_not_saved() -> None:
    assert _save(_route(), _end(prompt_n=200, cache_n=55)) is None  # 255 of the default 256
    assert _save(_route(), _end(prompt_n=200, cache_n=56)) is not None
    assert _save(_route(), _end(prompt_n=200, policy=HeadsPolicy(min_tokens=100))) is not None


def test_a_turn_with_a_reply_in_its_prompt_is_saved_as_its_sessions_state_once_idle() -> None:
    history = _route(pieces=(SYSTEM, USER, REPLY, USER))
    read: list[int] = []

    def blocks() -> tuple[tuple[bytes, ...], ...]:
        read.append(1)
        return BLOCKS

    save = _save(history, replace(_end(first=True), blocks=blocks))  # its texts are read only for a first turn
    assert save is not None and save.idle_s == 30.0 and save.turn.session == "s", save
    assert save.turn.blocks == () and read == []
    later = _save(_route(), _end(first=False))  # not the store's first of the session there: its state too
    assert later is not None and later.idle_s == 30.0 and later.turn.session == "s"
    assert _save(_route(), _end(first=False, policy=HeadsPolicy(session_idle_s=0))) is None  # sessions not kept


def test_a_side_request_is_not_saved_and_leaves_the_sessions_waiting_state_alone() -> None:
    after = plan_save(_route(side=True), _end(first=False))
    assert after is not None and after.save is None and after.session is None, after
    main = plan_save(_route(), _end(first=False, prompt_n=10))  # too short to save, but a newer turn of the line
    assert main is not None and main.save is None and main.session == "s"


@pytest.mark.parametrize("status", [400, 500, 502])
def test_a_request_not_served_in_full_asks_nothing(status: int) -> None:
    assert plan_save(_route(), _end(status=status)) is None
    assert plan_save(_route(), replace(_end(), timings=None)) is None
    assert plan_save(_route(session=None), _end()) is None  # no session assigned
    assert plan_save(_route(pieces=()), _end()) is None


def test_the_heads_policy_off_asks_nothing_and_a_router_mode_preset_keeps_no_save() -> None:
    assert plan_save(_route(), _end(policy=HeadsPolicy(enabled=False))) is None
    preset = plan_save(_route(), _end(preset=True))
    assert preset == AfterTurn("", 0, session="s", mark=MARK), preset


def test_a_restored_head_is_judged_on_what_its_request_reused_unless_usage_left_it_out() -> None:
    restored = Restored("abc", URL, tokens=2400, restore_ms=12.0)
    inert = plan_save(_route(), _end(cache_n=0, restored=restored))
    assert inert is not None and inert.restored == restored and inert.inert and inert.cache_n == 0
    assert inert.mark == MARK  # the judge compares the counts all proxies share from the request's own mark
    reused = plan_save(_route(), _end(cache_n=2400, restored=restored))
    assert reused is not None and reused.restored == restored and not reused.inert
    unknown = plan_save(_route(), _end(restored=restored, from_usage=True))
    assert unknown is not None and unknown.restored is None
    shared = plan_save(_route(), _end(policy=HeadsPolicy(share_gb=0.5)))
    assert shared is not None and shared.share_bytes == 512 * 1024**2
