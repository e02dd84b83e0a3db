"""The router's choice among every speculation setting of one server (no speculation, the model drafter, drafter +
n-gram, n-grams alone): from the session's measured drafter acceptance and copyability, the text's kind, the load,
and the draft length. Pure: decide(), the speed model, the text kind and the draft length, no server."""

from __future__ import annotations

from dataclasses import replace

import pytest

from adaptive_spec.policy.model import Policy, RoutePolicy
from adaptive_spec.routing.decide import decide
from adaptive_spec.routing.draft_length import accepted_share, draft_cap, per_token_acceptance
from adaptive_spec.routing.estimate import ProfileState, RequestState, SessionState
from adaptive_spec.routing.placements import Placement, Placements, observe
from adaptive_spec.routing.prompt.first_turn import text_kind
from adaptive_spec.routing.speeds import SpeedModel
from adaptive_spec.streams.timings import parse_timings
from adaptive_spec.telemetry.records import Timings

SETTINGS = {
    "plain": ("none",),
    "oneshot": ("draft-simple",),
    "iterative": ("draft-simple", "ngram-mod"),
    "ngram": ("ngram-mod",),
}
SERVER = "plain#0"
ALL = frozenset(SETTINGS)


def _timings(ms_per_token: float, drafted: int = 0, accepted: int = 0, ngram: tuple[int, int] = (0, 0)) -> Timings:
    """One 200-token answer at 1,000 tokens of context; `drafted`/`accepted`: the model drafter's, `ngram`: the
    n-gram drafter's (as a patched server splits them)."""
    return Timings(
        prompt_n=100,
        cache_n=900,
        predicted_n=200,
        prompt_ms=100.0,
        predicted_ms=200 * ms_per_token,
        draft_n=drafted + ngram[0],
        draft_n_accepted=accepted + ngram[1],
        drafter_n=drafted,
        drafter_n_accepted=accepted,
    )


def _speeds(drafter_ms: dict[float, float]) -> SpeedModel:
    """Speeds as measured: plain at 50 ms/token; the drafter at each acceptance's ms/token (many requests each)."""
    speeds = SpeedModel(Policy().estimator, Policy().handoff, SETTINGS)
    for _ in range(20):
        speeds.observe("plain", 0.0, _timings(50.0), 4000)
        for share, ms in drafter_ms.items():
            speeds.observe("oneshot", 0.0, _timings(ms, 100, int(100 * share)), 4000)
    return speeds


GPU_LIKE = {0.2: 60.0, 0.8: 20.0}  # the drafter loses on rejected drafts, wins big on accepted ones
CPU_LIKE = {0.2: 130.0, 0.9: 65.0}  # a 0.5B drafting for a 1.5B on 2 cores: slower than plain even when accepted


def _profiles(**changes: object) -> list[ProfileState]:
    return [
        ProfileState(n, slots=4, speculates=n != "plain", server=SERVER, **changes)  # type: ignore[arg-type]
        for n in SETTINGS
    ]


def _session(acceptance: float | None, copy_share: float | None, profile: str = "oneshot") -> SessionState:
    placement = Placement(profile, None, 2000, 3, 200, drafter_acceptance=acceptance, drafter_turns=3)
    return SessionState("s", 3, copy_share, placement, same_server=ALL - {profile})


@pytest.mark.parametrize(
    ("name", "drafter_ms", "acceptance", "copy_share", "chosen", "because"),
    [
        # A prose session whose drafts are rejected: no speculation, and the reason gives the acceptance.
        ("prose rejected", GPU_LIKE, 0.15, 0.0, "plain", "drafter accepts 15% (3-turn avg)"),
        # Code whose drafts are accepted, nothing to copy: the drafter alone.
        ("code accepted", GPU_LIKE, 0.85, 0.0, "oneshot", "drafter accepts 85%"),
        # An edit session: drafter + n-gram.
        ("edit", GPU_LIKE, 0.85, 0.9, "iterative", "copyable 90%"),
        # An edit session on a CPU where the drafter is a loss whatever it accepts: n-grams alone.
        ("edit, slow drafter", CPU_LIKE, 0.9, 0.9, "ngram", "copyable 90%"),
        # Code on that CPU: no speculation, though the drafter's guesses are good.
        ("code, slow drafter", CPU_LIKE, 0.9, 0.0, "plain", "drafter accepts 90%"),
    ],
)
def test_the_router_chooses_among_every_setting(
    name: str, drafter_ms: dict[float, float], acceptance: float, copy_share: float, chosen: str, because: str
) -> None:
    decision = decide(
        RequestState(8000, prompt_tokens=2100, shared_tokens=2000),
        _session(acceptance, copy_share),
        _profiles(),
        _speeds(drafter_ms),
        Policy(),
    )
    assert decision.profile == chosen, (name, decision.reason)
    assert because in decision.reason, decision.reason
    assert {e.profile for e in decision.estimates} == set(SETTINGS)  # every setting was estimated
    assert "same server" in decision.reason or decision.profile == "oneshot"  # no move: the KV stays in its slot


def test_a_first_turn_of_prose_starts_from_the_prose_prior() -> None:
    speeds = _speeds(GPU_LIKE)
    new = SessionState(None, 0, None, None)
    prose = decide(RequestState(800, text_kind="prose"), new, _profiles(), speeds, Policy())
    code = decide(RequestState(800, text_kind="code"), new, _profiles(), speeds, Policy())
    assert "prior for prose" in prose.reason and "prior for code" in code.reason
    assert (prose.acceptance, code.acceptance) == (0.15, 0.6)
    assert code.profile == "oneshot"  # the drafter at the code prior beats no speculation on this GPU-like server
    assert prose.profile == "plain"  # ... and at the prose prior it does not
    one = {e.profile: e.total_s for e in prose.estimates}
    two = {e.profile: e.total_s for e in code.estimates}
    assert one["oneshot"] > two["oneshot"] and one["plain"] == two["plain"]


def test_load_holds_speculation_back_beside_plain_requests() -> None:
    session = _session(0.85, 0.9, profile="iterative")
    request = RequestState(8000, prompt_tokens=2100, shared_tokens=2000)
    speeds = _speeds(GPU_LIKE)
    alone = decide(request, session, _profiles(in_flight=0), speeds, Policy())
    assert alone.profile == "iterative" and alone.kind != "load"
    # Beside fewer plain requests than the rule's 3 (2 streams: drafting still gained in total), it speculates.
    two = decide(request, session, _profiles(in_flight=2, plain_beside=2), speeds, Policy())
    assert two.profile == "iterative" and two.kind != "load"
    busy = decide(request, session, _profiles(in_flight=3, plain_beside=3), speeds, Policy())
    assert (busy.profile, busy.kind) == ("plain", "load"), busy.reason
    assert "iterative held back: load: 3 request(s) without speculation" in busy.reason
    assert "(route.hold_beside_plain = 3)" in busy.reason
    # Beside other speculating requests it keeps speculating; the policy sets the threshold, 0 turns the rule off.
    beside = decide(request, session, _profiles(in_flight=3), speeds, Policy())
    assert beside.profile == "iterative"
    one = Policy(route=RoutePolicy(hold_beside_plain=1))
    assert decide(request, session, _profiles(in_flight=1, plain_beside=1), speeds, one).profile == "plain"
    off = Policy(route=RoutePolicy(hold_beside_plain=0))
    assert decide(request, session, _profiles(in_flight=3, plain_beside=3), speeds, off).profile == "iterative"
    # A busy server: at speculate_max_busy requests in flight nothing speculates.
    capped = Policy(route=RoutePolicy(speculate_max_busy=2))
    full = decide(request, session, _profiles(in_flight=2), speeds, capped)
    assert (full.profile, full.kind) == ("plain", "load") and "route.speculate_max_busy = 2" in full.reason
    # A forced setting is not held back, and a server without a plain setting keeps speculating.
    forced = Policy(route=RoutePolicy(force="iterative"))
    assert decide(request, session, _profiles(in_flight=3, plain_beside=3), speeds, forced).profile == "iterative"
    own_servers = [replace(p, server="") for p in _profiles(in_flight=3, plain_beside=3)]
    assert decide(request, session, own_servers, speeds, Policy()).kind != "load"


def test_a_drafter_line_is_learned_from_each_responses_acceptance() -> None:
    speeds = _speeds(CPU_LIKE)
    reference = speeds.reference_s_per_token()
    assert reference == pytest.approx(0.050, rel=0.1)  # measured, with the prior's weight
    # The line has left its prior (2× at acceptance 1) for the measured points (2.6 and 1.3 times plain's time; the
    # ridge still leans toward the prior's slope), its slope says acceptance helps, and even accepted drafts lose.
    low, high = speeds.drafter_factor("oneshot", 0.2), speeds.drafter_factor("oneshot", 0.9)
    assert low == pytest.approx(130 / 50, rel=0.2) and high == pytest.approx(65 / 50, rel=0.2)
    assert low > high > 1.0
    # The drafter + n-gram setting shares the drafter's line: one drafter, measured once.
    assert speeds.drafter_factor("iterative", 0.5) == speeds.drafter_factor("oneshot", 0.5)
    # A fast drafter answer barely moves the reference (only through the prior of plain's mean): no speculation is
    # measured on its own setting, drafter's cost included.
    speeds.observe("oneshot", 0.0, _timings(10.0, 100, 95), 4000)
    assert speeds.reference_s_per_token() == pytest.approx(reference, rel=0.01)
    # Responses without drafter counts (none drafted) teach the drafter's line nothing.
    before = speeds.drafter_factor("oneshot", 0.5)
    speeds.observe("oneshot", 0.0, _timings(500.0), 4000)
    assert speeds.drafter_factor("oneshot", 0.5) == before


def test_placements_keep_the_sessions_drafter_acceptance_from_llama_servers_counts() -> None:
    speeds = SpeedModel(Policy().estimator, Policy().handoff, SETTINGS)
    places = Placements()
    observe(speeds, places, "oneshot", None, "s", 0.0, _timings(50.0, 100, 20), 4000)
    first = places.get("s")
    assert first is not None and (first.drafter_acceptance, first.drafter_turns) == (0.2, 1)
    assert first.drafted_per_step == pytest.approx(100 / (200 - 20))  # drafted over steps (outputs not accepted)
    # With n-grams too, only the drafter's own counts say what it accepted.
    observe(speeds, places, "iterative", None, "s", 0.0, _timings(50.0, 100, 60, ngram=(64, 64)), 4000)
    second = places.get("s")
    assert second is not None and second.drafter_acceptance == pytest.approx(0.4) and second.drafter_turns == 2
    # 200 outputs, 124 of them accepted drafts: 76 steps; the drafter drafted 100 of the 164 drafted tokens.
    assert second.drafted_per_step == pytest.approx(0.5 * 100 / 76 + 0.5 * 100 / 180)
    # A turn on no speculation leaves the measured acceptance as it was.
    observe(speeds, places, "plain", None, "s", 0.0, _timings(50.0), 4000)
    assert places.get("s").drafter_acceptance == pytest.approx(0.4)  # type: ignore[union-attr]


def test_patched_servers_draft_counts_by_type_are_read() -> None:
    raw = {
        "predicted_n": 10,
        "draft_n": 30,
        "draft_n_accepted": 12,
        "draft_by_type": {
            "draft-simple": {"draft_n": 20, "draft_n_accepted": 4},
            "ngram-mod": {"draft_n": 10, "draft_n_accepted": 8},
        },
    }
    timings = parse_timings(raw)
    assert timings is not None and (timings.drafter_n, timings.drafter_n_accepted) == (20, 4)
    stock = parse_timings({"draft_n": 30, "draft_n_accepted": 12})
    assert stock is not None and (stock.drafter_n, stock.drafter_n_accepted) == (0, 0)


@pytest.mark.parametrize(
    ("body", "copy_hint", "copy_share", "kind"),
    [
        (
            {"messages": [{"role": "user", "content": "Write a short friendly email to my landlord."}]},
            False,
            None,
            "prose",
        ),
        (
            {"messages": [{"role": "user", "content": "Write a Python function that merges two lists."}]},
            False,
            None,
            "code",
        ),
        ({"messages": [{"role": "user", "content": "x = 1;\n"}]}, False, None, "code"),
        (
            {"messages": [{"role": "user", "content": "Describe Lisbon."}], "tools": [{"type": "function"}]},
            False,
            None,
            "code",
        ),
        ({"messages": [{"role": "user", "content": "Describe Lisbon."}]}, True, None, "edit"),
        ({"messages": [{"role": "user", "content": "Describe Lisbon."}]}, False, 0.5, "edit"),
        ({"input": "Tell me a story about a lighthouse keeper."}, False, None, "prose"),
        ({"prompt": "def add(a, b):"}, False, None, "code"),
    ],
)
def test_text_kind(body: dict[str, object], copy_hint: bool, copy_share: float | None, kind: str) -> None:
    assert text_kind(body, copy_hint, copy_share) == kind


def test_draft_length_follows_the_measured_acceptance() -> None:
    for alpha in (0.1, 0.5, 0.9):
        for n in (2, 8, 15):
            assert per_token_acceptance(accepted_share(alpha, n), n) == pytest.approx(alpha, abs=1e-6)
    caps = [draft_cap(share, 15, 16, 0.3) for share in (0.05, 0.3, 0.6, 0.9)]
    assert caps == sorted(caps) and caps[0] == 1 and caps[-1] >= 8, caps  # longer drafts as more is accepted
    assert draft_cap(0.6, 15, 16, 0.0) == 16  # drafting that costs nothing: the longest draft
    assert draft_cap(1.0, 15, 4, 0.3) == 4  # never beyond the server's own cap


@pytest.mark.parametrize(("workload", "kind"), [("prose", "prose"), ("oneshot", "code"), ("iterative", "code")])
def test_the_shipped_workloads_prompts_are_read_as_their_kind(workload: str, kind: str) -> None:
    from adaptive_spec.bench.runner import load_workload

    work = load_workload(workload)
    kinds = {text_kind({"messages": [{"role": "user", "content": r.user or ""}]}, False, None) for r in work.requests}
    assert kinds == {kind}
