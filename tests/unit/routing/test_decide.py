"""decide(): table-driven cases over the cost model, hysteresis, dwell, pins, forcing, fallback and handoff; the
speed model's priors and learning."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from adaptive_spec.policy.model import FirstTurnPolicy, HandoffPolicy, Policy, RoutePolicy
from adaptive_spec.routing.decide import decide
from adaptive_spec.routing.estimate import ProfileState, RequestState, SessionState
from adaptive_spec.routing.placements import Placement, Placements
from adaptive_spec.routing.prompt.first_turn import looks_copy_heavy
from adaptive_spec.routing.speeds import SpeedModel
from adaptive_spec.telemetry.records import Timings

KINDS = {"oneshot": ("none",), "iterative": ("ngram-mod",)}
BYTES_PER_TOKEN = 3.5


def speeds(policy: Policy | None = None) -> SpeedModel:
    p = policy or Policy()
    return SpeedModel(p.estimator, p.handoff, KINDS)


def profiles(handoff: bool = True, **changes: Any) -> list[ProfileState]:
    out = []
    for name in KINDS:
        state = ProfileState(name, handoff=handoff)
        out.append(replace(state, **changes.get(name, {})))
    return out


def tokens(n: int) -> int:
    return int(n * BYTES_PER_TOKEN)


NEW = SessionState("s", 0, None, None)


def placed(profile: str, copy: float, turns_here: int = 3, cached: int = 6000, out: float = 300) -> SessionState:
    return SessionState("s", 4, copy, Placement(profile, 0, cached, turns_here, out))


# (name, request, session, policy changes, profile changes, expected profile, expected kind, reason must contain)
CASES = [
    ("first turn, nothing to copy", RequestState(tokens(300)), NEW, {}, {}, "oneshot", "estimate", "no history"),
    (
        "first turn pasting a file to return whole",
        RequestState(tokens(3000), copy_hint=True),
        NEW,
        {},
        {},
        "iterative",
        "estimate",
        "prompt asks for a pasted file back",
    ),
    (
        "copy-heavy session stays on its n-gram profile",
        RequestState(tokens(6500)),
        placed("iterative", 0.85),
        {},
        {},
        "iterative",
        "estimate",
        "stays on its KV cache",
    ),
    (
        "copy share fell, but the dwell is not over",
        RequestState(tokens(6500)),
        placed("iterative", 0.0, turns_here=1),
        {},
        {},
        "iterative",
        "stay",
        "dwell",
    ),
    (
        "copy share fell, gain under the hysteresis",
        RequestState(tokens(6500)),
        placed("iterative", 0.0),
        {},
        {},
        "iterative",
        "stay",
        "hysteresis",
    ),
    (
        "copyable session on the plain profile moves, KV handed over",
        RequestState(tokens(6500)),
        placed("oneshot", 0.9),
        {},
        {},
        "iterative",
        "estimate",
        "hands its KV over from oneshot",
    ),
    (
        "without handoff a huge context is not worth re-prefilling",
        RequestState(tokens(30500)),
        placed("oneshot", 0.9, cached=30000),
        {"handoff": HandoffPolicy(enabled=False)},
        {},
        "oneshot",
        "estimate",
        "stays on its KV cache",
    ),
    (
        "without handoff a small context moves and re-prefills",
        RequestState(tokens(900)),
        placed("oneshot", 0.9, cached=800),
        {"handoff": HandoffPolicy(enabled=False)},
        {},
        "iterative",
        "estimate",
        "switch re-prefills",
    ),
    ("a pin wins", RequestState(tokens(300), pinned="iterative"), NEW, {}, {}, "iterative", "pinned", "pinned"),
    (
        "a forced profile wins",
        RequestState(tokens(300)),
        NEW,
        {"route": RoutePolicy(force="iterative")},
        {},
        "iterative",
        "forced",
        "forced by the policy",
    ),
    (
        "a forced profile that is down falls back",
        RequestState(tokens(300)),
        NEW,
        {"route": RoutePolicy(force="iterative")},
        {"iterative": {"down_reason": "exited"}},
        "oneshot",
        "fallback",
        "iterative is down (exited)",
    ),
    (
        "the session's profile is down: move",
        RequestState(tokens(6500)),
        placed("iterative", 0.9),
        {},
        {"iterative": {"down_reason": "restarting"}},
        "oneshot",
        "fallback",
        "iterative is down (restarting)",
    ),
    (
        "the session's profile is overloaded: move",
        RequestState(tokens(6500)),
        placed("iterative", 0.9),
        {},
        {"iterative": {"in_flight": 3}},
        "oneshot",
        "fallback",
        "overloaded",
    ),
    (
        "the plain profile is down: a one-shot goes to the other",
        RequestState(tokens(300)),
        NEW,
        {},
        {"oneshot": {"down_reason": "exited"}},
        "iterative",
        "fallback",
        "oneshot is down (exited)",
    ),
    (
        "every profile down",
        RequestState(tokens(300)),
        NEW,
        {},
        {"oneshot": {"down_reason": "x"}, "iterative": {"down_reason": "y"}},
        "oneshot",
        "fallback",
        "every profile",
    ),
    (
        "the policy allows one profile",
        RequestState(tokens(300), copy_hint=True),
        NEW,
        {"route": RoutePolicy(profiles=("oneshot",))},
        {},
        "oneshot",
        "only",
        "only profile",
    ),
    (
        "exploration tries the runner-up on a new session",
        RequestState(tokens(3000), copy_hint=True, explore_draw=0.01),
        NEW,
        {"route": RoutePolicy(explore=0.05)},
        {},
        "oneshot",
        "explore",
        "exploring",
    ),
    (
        "a first turn with nothing to copy is not explored on the n-gram profile",
        RequestState(tokens(300), explore_draw=0.01),
        NEW,
        {"route": RoutePolicy(explore=0.05)},
        {},
        "oneshot",
        "estimate",
        "no history",
    ),
    (
        "the only allowed profile is down: a fallback, not 'only'",
        RequestState(tokens(300)),
        NEW,
        {"route": RoutePolicy(profiles=("oneshot",))},
        {"oneshot": {"down_reason": "exited"}},
        "iterative",
        "fallback",
        "oneshot is down (exited)",
    ),
    (
        "a forced profile outside route.profiles is still forced",
        RequestState(tokens(300)),
        NEW,
        {"route": RoutePolicy(profiles=("oneshot",), force="iterative")},
        {},
        "iterative",
        "forced",
        "forced",
    ),
    (
        "every profile overloaded: the least loaded",
        RequestState(tokens(300)),
        NEW,
        {},
        {"oneshot": {"in_flight": 9}, "iterative": {"in_flight": 4}},
        "iterative",
        "fallback",
        "oneshot is overloaded",
    ),
    (
        "no dwell for a session whose KV is gone",
        RequestState(tokens(900)),
        SessionState("s", 4, 0.9, Placement("oneshot", 0, 0, 1, 300)),
        {},
        {},
        "iterative",
        "estimate",
        "switch re-prefills",
    ),
    (
        "no exploration for a placed session",
        RequestState(tokens(6500), explore_draw=0.01),
        placed("iterative", 0.9),
        {"route": RoutePolicy(explore=0.05)},
        {},
        "iterative",
        "estimate",
        "stays on its KV cache",
    ),
]


@pytest.mark.parametrize(
    ("request_state", "session", "policy_changes", "profile_changes", "profile", "kind", "reason"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_decide(
    request_state: RequestState,
    session: SessionState,
    policy_changes: dict[str, object],
    profile_changes: dict[str, Any],
    profile: str,
    kind: str,
    reason: str,
) -> None:
    policy = replace(Policy(), **policy_changes)  # type: ignore[arg-type]
    decision = decide(request_state, session, profiles(**profile_changes), speeds(policy), policy)
    assert (decision.profile, decision.kind) == (profile, kind), decision.reason
    assert reason in decision.reason
    assert decision.reason.startswith(f"{profile}:")


def test_a_move_with_handoff_is_planned_and_priced() -> None:
    decision = decide(RequestState(tokens(6500)), placed("oneshot", 0.9), profiles(), speeds(), Policy())
    assert decision.moved_from == "oneshot" and decision.handoff and decision.handoff_tokens == 6000
    by = {e.profile: e for e in decision.estimates}
    assert by["iterative"].handoff_s > 0 and by["iterative"].prefill_tokens == tokens(6500) // 3.5 - 6000
    assert by["oneshot"].handoff_s == 0 and by["oneshot"].prefill_tokens == by["iterative"].prefill_tokens
    assert "pays back this turn" in decision.reason


def test_no_handoff_when_a_profile_has_no_shared_slot_dir() -> None:
    decision = decide(
        RequestState(tokens(900)),
        placed("oneshot", 0.9, cached=800),
        profiles(handoff=False),
        speeds(),
        replace(Policy(), handoff=HandoffPolicy(min_tokens=0)),
    )
    assert decision.profile == "iterative" and not decision.handoff and decision.moved_from == "oneshot"


def test_a_hint_raises_a_low_history_share() -> None:
    session = SessionState("s", 3, 0.05, None)
    decision = decide(RequestState(tokens(3000), copy_hint=True), session, profiles(), speeds(), Policy())
    assert decision.profile == "iterative" and decision.copy_share == pytest.approx(0.6)


def test_reason_names_the_average_it_used() -> None:
    session = SessionState("s", 3, 0.71, Placement("iterative", 0, 6000, 3, 300))
    decision = decide(RequestState(tokens(6500)), session, profiles(), speeds(), Policy())
    assert "copyable 71% (3-turn avg)" in decision.reason


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Here is app.py:\n```python\n" + "x = 1\n" * 30 + "```\nReturn the complete updated file.", True),
        ("Here is app.py:\n```python\n" + "x = 1\n" * 5 + "```\nReturn the complete updated file.", False),
        ("Here is app.py:\n```python\n" + "x = 1\n" * 30 + "```\nWhat does it do?", False),
        ("REWRITE THE FILE below\n" + "line\n" * 25, True),
        ("", False),
    ],
)
def test_looks_copy_heavy(text: str, expected: bool) -> None:
    assert looks_copy_heavy(text, FirstTurnPolicy()) is expected


def test_the_file_may_be_pasted_in_an_earlier_message() -> None:
    pasted = "```python\n" + "x = 1\n" * 30 + "```"
    assert looks_copy_heavy("Now return the complete updated file.", FirstTurnPolicy(), [pasted, "ok"])
    assert not looks_copy_heavy("Now return the complete updated file.", FirstTurnPolicy(), ["short", "ok"])
    assert not looks_copy_heavy("Thanks!", FirstTurnPolicy(), [pasted])


def _timings(tps: float, n: int = 200, context: int = 4000, prompt_n: int = 100, prefill_tps: float = 500.0) -> Timings:
    prompt_ms = prompt_n / prefill_tps * 1000
    return Timings(
        prompt_n=prompt_n,
        cache_n=context - prompt_n,
        predicted_n=n,
        prompt_ms=prompt_ms,
        predicted_ms=n / tps * 1000,
        predicted_per_second=tps,
    )


def test_priors_before_any_measurement() -> None:
    model = speeds()
    plain = 1 / model.decode_s_per_token("oneshot", 0.9, 0)
    ngram_copy = 1 / model.decode_s_per_token("iterative", 0.9, 0)
    ngram_plain = 1 / model.decode_s_per_token("iterative", 0.0, 0)
    assert plain == pytest.approx(40.0)
    assert ngram_copy / plain == pytest.approx(1 / (1.03 * (1 - (1 - 1 / 3) * 0.9)))
    assert ngram_plain < plain  # the n-gram profile's small overhead on output it cannot copy
    assert model.decode_s_per_token("oneshot", 0, 8000) > model.decode_s_per_token("oneshot", 0, 0)


def test_measured_speeds_take_over_from_the_priors() -> None:
    model = speeds()
    for _ in range(40):
        model.observe("oneshot", 0.0, _timings(12.0), body_bytes=14_000)
        model.observe("iterative", 0.9, _timings(30.0), body_bytes=14_000)
        model.observe("iterative", 0.0, _timings(11.6), body_bytes=14_000)
    assert 1 / model.decode_s_per_token("oneshot", 0.0, 4100) == pytest.approx(12.0, rel=0.08)
    assert 1 / model.decode_s_per_token("iterative", 0.9, 4100) == pytest.approx(30.0, rel=0.1)
    # on output it cannot copy, the n-gram profile is the plain speed less the overhead (structure, not a fit)
    plain = 1 / model.decode_s_per_token("oneshot", 0.0, 4100)
    assert 1 / model.decode_s_per_token("iterative", 0.0, 4100) == pytest.approx(plain / 1.03)
    assert model.prefill_s("oneshot", 1000) == pytest.approx(2.0, rel=0.1)
    assert model.prompt_tokens(14_000) == pytest.approx(4000, rel=0.1)


def test_a_profile_without_data_follows_the_measured_base_speed() -> None:
    model = speeds()
    for _ in range(30):
        model.observe("oneshot", 0.0, _timings(10.0, context=200), body_bytes=700)
    assert 1 / model.decode_s_per_token("iterative", 0.0, 200) == pytest.approx(10.0 / 1.03, rel=0.1)


def test_n_gram_numbers_alone_never_make_it_faster_on_text_it_cannot_copy() -> None:
    # Only edit-session measurements on the n-gram profile, far better than the prior: the plain profile (never
    # measured) must still win a one-shot prompt, or nothing would ever send it one.
    model = speeds()
    for _ in range(50):
        model.observe("iterative", 0.85, _timings(300.0), body_bytes=14_000)
    assert model.decode_s_per_token("oneshot", 0.0, 500) < model.decode_s_per_token("iterative", 0.0, 500)
    assert model.decode_s_per_token("iterative", 0.85, 4100) == pytest.approx(1 / 300.0, rel=0.1)


def test_handoff_cost_is_learned() -> None:
    model = speeds()
    assert model.handoff_s(10_000) == pytest.approx(0.4 + 0.02)
    for _ in range(30):
        model.observe_handoff(10_000, save_s=0.3, restore_s=0.01)
    assert model.handoff_s(10_000) == pytest.approx(0.31, rel=0.1)


def test_placements_track_dwell_and_displacement() -> None:
    book = Placements(max_sessions=2)
    book.served("a", "iterative", 0, 1000, 100)
    book.served("a", "iterative", 0, 2000, 300)
    assert book.get("a") == Placement("iterative", 0, 2000, 2, 200.0)
    book.served("a", "oneshot", 0, 2500, 100)
    assert book.get("a").turns_here == 1  # type: ignore[union-attr]
    book.served("b", "iterative", 0, 500, 10)
    book.displace("iterative", 0, keep="a")
    assert book.get("b").in_slot is False and book.get("b").cached_tokens == 500  # type: ignore[union-attr]
    assert book.get("a").in_slot is True  # type: ignore[union-attr]
    book.served("c", "iterative", 0, 500, 10)
    assert book.get("a") is None and len(book) == 2


def test_no_handoff_from_a_slot_another_session_took_over() -> None:
    gone = SessionState("s", 4, 0.9, Placement("oneshot", 0, 6000, 3, 300, in_slot=False))
    decision = decide(RequestState(tokens(6500)), gone, profiles(), speeds(), Policy())
    assert not decision.handoff


def test_no_handoff_of_an_empty_cache_even_with_min_tokens_zero() -> None:
    empty = SessionState("s", 4, 0.9, Placement("oneshot", 0, 0, 3, 300))
    policy = replace(Policy(), handoff=HandoffPolicy(min_tokens=0))
    decision = decide(RequestState(tokens(900)), empty, profiles(), speeds(policy), policy)
    assert decision.moved_from == "oneshot" and not decision.handoff and decision.handoff_tokens == 0


def test_max_tokens_caps_the_expected_output() -> None:
    session = placed("iterative", 0.9, out=2000)
    capped = decide(RequestState(tokens(6500), max_tokens=50), session, profiles(), speeds(), Policy())
    free = decide(RequestState(tokens(6500)), session, profiles(), speeds(), Policy())
    assert {e.output_tokens for e in capped.estimates} == {50}
    assert {e.output_tokens for e in free.estimates} == {2000}


@pytest.mark.parametrize(("hysteresis", "moves"), [(0.30, True), (0.60, False)])
def test_the_hysteresis_is_the_margin_a_move_must_beat(hysteresis: float, moves: bool) -> None:
    # On the plain profile, copyable 0.9: the n-gram profile is estimated ~2.4x faster in decode, ~50% less time.
    policy = replace(Policy(), route=RoutePolicy(hysteresis=hysteresis))
    decision = decide(RequestState(tokens(6500)), placed("oneshot", 0.9), profiles(), speeds(policy), policy)
    by = {e.profile: e.total_s for e in decision.estimates}
    gain = 1 - by["iterative"] / by["oneshot"]
    assert 0.30 < gain < 0.60
    assert (decision.profile == "iterative") is moves


@pytest.mark.parametrize(("allowed", "expected"), [(False, False), (True, True)])
def test_no_handoff_with_draft_model_profiles_unless_allowed(allowed: bool, expected: bool) -> None:
    policy = replace(Policy(), handoff=HandoffPolicy(with_draft_models=allowed))
    pair = [replace(p, draft_model=True) for p in profiles()]
    decision = decide(RequestState(tokens(6500)), placed("oneshot", 0.9), pair, speeds(policy), policy)
    move = next(e for e in decision.estimates if e.profile == "iterative")
    if expected:
        assert decision.profile == "iterative" and decision.handoff and move.handoff_s > 0
    else:  # a move would re-prefill all 6,500 tokens: staying on its KV cache is cheaper
        assert decision.profile == "oneshot" and not decision.handoff
        assert move.handoff_s == 0 and move.prefill_tokens == 6500


def test_answers_too_short_to_time_do_not_teach_the_n_gram_gain_but_an_agents_calls_do() -> None:
    model = speeds()
    before = model.gain("iterative")
    for _ in range(20):  # 24-token answers: per-request overheads, they look slow per token
        model.observe("iterative", 0.6, _timings(5.0, n=24), body_bytes=14_000)
    assert model.gain("iterative") == before
    # A 37-token tool call, copied from context, drafted 64 tokens at a time and slower than plain decoding (the
    # replayed opencode session on 2 CPU cores: 4.2-5.8 tok/s against 9.5): the gain comes down, and with it the
    # speed the router expects.
    plain = 9.5
    model.observe("oneshot", 0.0, _timings(plain, n=37), body_bytes=14_000)
    expected = model.decode_s_per_token("iterative", 0.85, 4000)
    for tps in (4.2, 5.5, 5.8):
        model.observe("iterative", 0.85, _timings(tps, n=37), body_bytes=14_000)
    assert model.gain("iterative") < before / 2
    assert model.decode_s_per_token("iterative", 0.85, 4000) > 1.5 * expected
    assert model.decode_s_per_token("iterative", 0.85, 4000) > model.decode_s_per_token("oneshot", 0.85, 4000)


def test_a_handoff_is_priced_by_the_prefix_the_prompt_shares_with_the_slot() -> None:
    """aider rewrites its history: a slot of 6,000 tokens of which the new prompt shares 2,000. The move re-uses only
    those 2,000, and the estimate says so."""
    request = RequestState(tokens(6500), prompt_tokens=6500, shared_tokens=2000)
    decision = decide(request, placed("oneshot", 0.9), profiles(), speeds(), Policy())
    by = {e.profile: e for e in decision.estimates}
    assert by["oneshot"].prefill_tokens == 4500 and by["iterative"].prefill_tokens == 4500
    assert decision.profile == "iterative" and decision.handoff


def test_no_handoff_of_what_the_new_prompt_will_not_reuse() -> None:
    request = RequestState(tokens(6500), prompt_tokens=6500, shared_tokens=600)  # below handoff.min_tokens
    decision = decide(request, placed("oneshot", 0.9), profiles(), speeds(), Policy())
    by = {e.profile: e for e in decision.estimates}
    assert not decision.handoff and by["iterative"].handoff_s == 0 and by["iterative"].prefill_tokens == 6500


def test_a_handoff_dearer_than_the_prefill_it_saves_is_not_made() -> None:
    # Restoring a 30,000-token slot to reuse 1,100 tokens costs more than prefilling those 1,100.
    slow = replace(Policy(), handoff=HandoffPolicy(save_s_per_1k=1.0))
    request = RequestState(tokens(31000), prompt_tokens=31000, shared_tokens=1100)
    decision = decide(request, placed("oneshot", 0.9, cached=30000), profiles(), speeds(slow), slow)
    assert not decision.handoff and all(e.handoff_s == 0 for e in decision.estimates)


def test_a_session_with_a_request_in_flight_is_not_called_new() -> None:
    session = SessionState("s", 0, None, None, in_flight_on="oneshot")
    decision = decide(RequestState(tokens(300)), session, profiles(), speeds(), Policy())
    assert "new session" not in decision.reason and "still in flight on oneshot" in decision.reason
    assert "new session" in decide(RequestState(tokens(300)), NEW, profiles(), speeds(), Policy()).reason
