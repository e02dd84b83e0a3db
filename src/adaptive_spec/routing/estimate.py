"""What a routing decision sees (the request, its session, each profile) and what serving the request on one profile is
estimated to cost, with the text that explains a move.

Pure.

Cost of serving the request on profile p:

    prompt tokens p must process / prefill speed of p   (all of them when the session's KV lives elsewhere,
                                                         only the new ones when it lives on p's server)
  + slot save + restore                                  (when the KV is handed over instead of re-prefilled)
  + expected output tokens × seconds/token of p given the session's copyability and context
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from adaptive_spec.kv.costs import PrefillRate
from adaptive_spec.policy.model import Policy
from adaptive_spec.routing.placements import Placement
from adaptive_spec.routing.speeds import Basis, SpeedModel


@dataclass(frozen=True, slots=True)
class ProfileState:
    name: str
    down_reason: str | None = None
    in_flight: int = 0
    slots: int = 1
    handoff: bool = False  # shares a slot directory with the other profiles: its KV can be saved and restored
    draft_model: bool = False  # drafts with a separate draft model, whose own cache a slot file does not hold
    speculates: bool = False  # drafts at all (a model drafter, n-grams, or both)
    server: str = ""  # the llama-server it runs on: profiles naming one are per-request settings of it ("": its own)
    plain_beside: int = 0  # requests without speculation in flight on that server, whichever profile they came for


@dataclass(frozen=True, slots=True)
class SessionState:
    session_id: str | None
    turns: int  # turns whose statistics are known
    copy_share: float | None  # estimated accepted share of n-gram drafts (EWMA over recent turns); None = no history
    placement: Placement | None
    in_flight_on: str | None = None  # a request of this session is being served there (its KV is not placed yet)
    # Other profiles on the server that holds its KV (per-request settings of one llama-server): a switch to one
    # keeps the slot and its cache, nothing is saved or restored.
    same_server: frozenset[str] = frozenset()
    # Per target profile: the share of restored tokens that handoffs from the profile holding its KV to it were
    # measured to reuse (llama-server's cache_n after the restore), and over how many handoffs; absent: none yet.
    handoff_reuse: Mapping[str, tuple[float, int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestState:
    body_bytes: int
    max_tokens: int | None = None
    copy_hint: bool = False  # the prompt itself asks to reproduce a pasted file
    hint_output_tokens: int = 0  # ... and the answer will be about this long (the pasted file's size)
    pinned: str | None = None  # the x-adaptive-spec-profile header, or the session's pin
    pinned_by: str = "the request header"  # or "the session's pin" (POST /adaptive/sessions/{id}/pin)
    explore_draw: float = 1.0  # uniform in [0, 1): below policy.route.explore, try another profile
    # From the session's prefix state (routing/prompt/prefix.py); None: estimate from the body's size.
    prompt_tokens: int | None = None  # the whole prompt, in the model's tokens
    shared_tokens: int | None = None  # its prefix that the session's KV cache holds
    shared_on: Mapping[str, int] | None = None  # per profile: its prefix that the slot it would use holds now
    text_kind: str = "code"  # edit | code | prose (routing/prompt/first_turn.py): the drafter's prior acceptance


@dataclass(frozen=True, slots=True)
class Estimate:
    profile: str
    prefill_tokens: int
    prefill_s: float
    handoff_s: float  # slot save + restore, when the KV is handed over
    output_tokens: int
    decode_tps: float
    speedup: float  # decode speed over decoding without speculation, at this context
    total_s: float
    basis: Basis = "prior"  # whether the prefill figure is the policy's prior or measured (`SpeedModel.basis`)
    prefill_rate: PrefillRate = field(default_factory=lambda: PrefillRate(0.0))  # the prefill line the figure took

    @property
    def prefill_text(self) -> str:
        """The prefill's figure as a reason shows it: its seconds and where its speed came from."""
        return f"≈ {self.prefill_s:.2f} s ({self.basis})"


def _fmt_tokens(n: int) -> str:
    return f"{n:,}"


def estimate_on(
    p: ProfileState,
    request: RequestState,
    session: SessionState,
    copy_share: float,
    acceptance: float,
    prompt_tokens: int,
    speeds: SpeedModel,
    policy: Policy,
    profiles: Mapping[str, ProfileState],
) -> Estimate:
    """The cost of serving the request on `p`: the prompt tokens its slot or the session's KV does not hold (or a
    handoff's restore instead), then the expected output at its decode speed."""
    placement = session.placement
    handoff_s = 0.0
    prefill_tokens = prompt_tokens
    held_here = min(prompt_tokens, request.shared_on.get(p.name, 0)) if request.shared_on is not None else 0
    prefill_tokens = prompt_tokens - held_here
    if placement is not None and placement.cached_tokens > 0 and not placement.overwritten:
        reuse = _reuse(placement, request, prompt_tokens)
        if placement.profile == p.name or p.name in session.same_server:
            prefill_tokens = prompt_tokens - max(reuse, held_here)
        elif _can_hand_off(placement, p, policy, profiles, reuse) and _handoffs_pay(session, p.name, policy):
            # Priced by the prefix the new prompt shares with the saved slot, and only when restoring that prefix is
            # cheaper than prefilling it (a rewritten history may reuse little of a large slot).
            cost = speeds.handoff_s(placement.cached_tokens)
            if reuse > held_here and cost < speeds.prefill_s(p.name, reuse - held_here, held_here):
                prefill_tokens = prompt_tokens - reuse
                handoff_s = cost
    out = placement.output_tokens if placement is not None else float(policy.estimator.output_tokens)
    if request.copy_hint and request.hint_output_tokens:
        out = max(out, float(request.hint_output_tokens))
    out_tokens = max(1, int(min(out, request.max_tokens) if request.max_tokens else out))
    context = prompt_tokens + out_tokens / 2
    s_per_token = speeds.decode_s_per_token(p.name, copy_share, context, acceptance)
    prefill_s = speeds.prefill_s(p.name, prefill_tokens, prompt_tokens - prefill_tokens)
    return Estimate(
        profile=p.name,
        prefill_tokens=prefill_tokens,
        prefill_s=prefill_s,
        handoff_s=handoff_s,
        output_tokens=out_tokens,
        decode_tps=1.0 / s_per_token,
        speedup=speeds.plain_s_per_token(context) / s_per_token,
        total_s=prefill_s + handoff_s + out_tokens * s_per_token,
        basis=speeds.basis(),
        prefill_rate=speeds.prefill_rate(),
    )


def _reuse(placement: Placement, request: RequestState, prompt_tokens: int) -> int:
    """The prompt tokens the session's cache can serve: the shared prefix when known, else all it holds."""
    held = min(placement.cached_tokens, prompt_tokens)
    return held if request.shared_tokens is None else min(request.shared_tokens, held)


def _can_hand_off(
    placement: Placement, to: ProfileState, policy: Policy, profiles: Mapping[str, ProfileState], reuse: int
) -> bool:
    source = profiles.get(placement.profile)
    return (
        policy.handoff.enabled
        and source is not None
        and source.down_reason is None
        and source.handoff
        and to.handoff
        and placement.in_slot
        and (policy.handoff.with_draft_models or not (source.draft_model or to.draft_model))
        and reuse > 0
        and reuse >= policy.handoff.min_tokens
    )


def _handoffs_pay(session: SessionState, to: str, policy: Policy) -> bool:
    """Whether handoffs to `to` from where the session's KV lives reuse enough of what they restore (unmeasured:
    assumed so)."""
    measured = session.handoff_reuse.get(to)
    return measured is None or measured[0] >= policy.handoff.min_reuse


def copyability(session: SessionState, request: RequestState, policy: Policy) -> tuple[float, str]:
    """The share of this turn's output an n-gram drafter is expected to produce, and where the figure comes from."""
    hint = policy.first_turn.copy_share if request.copy_hint else 0.0
    if session.copy_share is None:
        return hint, ("prompt asks for a pasted file back" if request.copy_hint else "no history")
    src = f"{session.turns}-turn avg" if session.turns > 1 else "last turn"
    if hint > session.copy_share:
        return hint, "prompt asks for a pasted file back"
    return session.copy_share, src


def acceptance(session: SessionState, request: RequestState, policy: Policy) -> tuple[float, str]:
    """The share of a model drafter's tokens this turn's output is expected to have accepted, and where the figure
    comes from: the session's measured acceptance (llama-server's counts), else the prior for its kind of text."""
    placement = session.placement
    if placement is not None and placement.drafter_acceptance is not None:
        turns = placement.drafter_turns
        return placement.drafter_acceptance, f"{turns}-turn avg" if turns > 1 else "last turn"
    e = policy.estimator
    if request.text_kind == "prose":
        return e.drafter_acceptance_prose, "prior for prose"
    return e.drafter_acceptance_code, f"prior for {'code being edited' if request.text_kind == 'edit' else 'code'}"


def move_text(chosen: Estimate, session: SessionState, min_reuse: float = 0.0) -> str:
    """What the session's KV costs on the chosen profile: a new session's prefill, a stay, a handoff, a re-prefill."""
    placement, in_flight_on = session.placement, session.in_flight_on
    if placement is None and in_flight_on is not None:  # not new: its first request has not finished yet
        return (
            f"its earlier request is still in flight on {in_flight_on}; prefills "
            f"{_fmt_tokens(chosen.prefill_tokens)} tok {chosen.prefill_text}"
        )
    if placement is None:
        return f"new session, prefills {_fmt_tokens(chosen.prefill_tokens)} tok {chosen.prefill_text}"
    if placement.profile == chosen.profile:
        return f"stays on its KV cache ({_fmt_tokens(chosen.prefill_tokens)} new tok {chosen.prefill_text})"
    if chosen.profile in session.same_server:
        return (
            f"same server as {placement.profile}: keeps its KV cache, no handoff "
            f"({_fmt_tokens(chosen.prefill_tokens)} new tok {chosen.prefill_text})"
        )
    if chosen.handoff_s > 0:
        return (
            f"hands its KV over from {placement.profile} ({_fmt_tokens(placement.cached_tokens)} tok ≈ "
            f"{chosen.handoff_s:.2f} s)"
        )
    text = f"switch re-prefills {_fmt_tokens(chosen.prefill_tokens)} tok {chosen.prefill_text}"
    measured = session.handoff_reuse.get(chosen.profile)
    if measured is not None and measured[0] < min_reuse:
        share, count = measured
        text += (
            f" (handoffs from {placement.profile} reused {share:.0%} of what they restored, {count} measured: "
            "none made)"
        )
    return text


def reason_text(
    chosen: Estimate,
    estimates: tuple[Estimate, ...],
    copy_share: float,
    copy_src: str,
    session: SessionState,
    kind: str,
    drafter: str = "",
    min_reuse: float = 0.0,
) -> str:
    """The estimate's line of reason: the chosen profile's estimate against the others', then `move_text`."""
    placement = session.placement
    others = [e for e in estimates if e.profile != chosen.profile]
    vs = ", ".join(f"{e.profile} {e.speedup:.1f}× ({e.total_s:.1f} s)" for e in others)
    head = (
        f"{chosen.profile}: copyable {copy_share:.0%} ({copy_src}){drafter} → est {chosen.speedup:.1f}× "
        f"({chosen.total_s:.1f} s)"
    )
    if vs:
        head += f" vs {vs}"
    tail = move_text(chosen, session, min_reuse)
    if placement is not None and placement.profile != chosen.profile and others:
        stay = next((e for e in others if e.profile == placement.profile), None)
        if stay is not None:
            tail += f", pays back this turn (saves {stay.total_s - chosen.total_s:.1f} s)"
    if kind == "explore":
        tail += "; exploring: not the estimated best, to measure it"
    return f"{head}; {tail}"
