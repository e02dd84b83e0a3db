"""The routing decision: which profile will finish this request soonest, counting the cost of moving a session.

`decide` is pure: it sees the request, the session (its copyability and where its KV cache lives), the profiles'
health and load, the learned speeds and the policy in force, and returns a Decision with one human line of reason.

Cost of serving the request on profile p:

    prompt tokens p must process / prefill speed of p   (all of them when the session's KV lives elsewhere,
                                                         only the new ones when it lives on p's server)
  + slot save + restore                                  (when the KV is handed over instead of re-prefilled)
  + expected output tokens × seconds/token of p given the session's copyability and context

A session stays where its KV lives unless another profile is estimated faster by more than the hysteresis, and not
before it has dwelt `min_dwell_turns` there. Profiles that are per-request settings of one llama-server share its
slots: a switch between them keeps the KV, costs nothing to move and needs no dwell ("same server"). A pin or a
forced profile overrides the estimate; a profile that is down or overloaded is passed over and the decision says why.

Load: a speculating profile is held back, for a setting of its server that does not speculate, while
`route.hold_beside_plain` requests without speculation decode on that server or once it has
`route.speculate_max_busy` requests in flight; the reason names the rule and the figure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from adaptive_spec.routing.placements import Placement
from adaptive_spec.routing.policy import Policy
from adaptive_spec.routing.speeds import SpeedModel


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
    # From the session's prefix state (sessions/prefix.py); None: estimate from the body's size.
    prompt_tokens: int | None = None  # the whole prompt, in the model's tokens
    shared_tokens: int | None = None  # its prefix that the session's KV cache holds
    shared_on: Mapping[str, int] | None = None  # per profile: its prefix that the slot it would use holds now
    text_kind: str = "code"  # edit | code | prose (routing/text_kind.py): the drafter's prior acceptance


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


@dataclass(frozen=True, slots=True)
class Decision:
    profile: str
    kind: str  # pinned | forced | estimate | stay | explore | fallback | only
    reason: str
    copy_share: float  # the copyability the estimate used
    context_tokens: int  # prompt tokens, estimated from the body
    acceptance: float = 0.0  # the drafter acceptance the estimate used (model-drafter profiles)
    moved_from: str | None = None  # the session's KV lived on this other profile
    handoff: bool = False  # save the slot on moved_from and restore it on `profile` before forwarding
    handoff_tokens: int = 0
    estimates: tuple[Estimate, ...] = ()
    new_tokens: int | None = None  # estimated tokens the profile's KV does not hold (None: no estimate)
    side: bool = False  # a side request of its session (title, commit message): not a turn of its main line
    line_moved: bool = False  # this request starts the session's main line: the requests before it were side ones
    # Which replica of the profile (routing/replicas.py chooses it after the profile is decided).
    replica: int = 0
    replica_kind: str = "only"  # only | stay | least-loaded | replaced | rebalanced
    replica_moved_from: int | None = None  # the session's KV lived on this other replica of the same profile
    # The draft length the router caps this request at (`speculative.n_max`; None: the profile's own setting).
    n_max: int | None = None


def _fmt_tokens(n: int) -> str:
    return f"{n:,}"


def _estimate(
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
    placement = session.placement
    handoff_s = 0.0
    prefill_tokens = prompt_tokens
    held_here = min(prompt_tokens, request.shared_on.get(p.name, 0)) if request.shared_on is not None else 0
    prefill_tokens = prompt_tokens - held_here
    if placement is not None and placement.cached_tokens > 0:
        reuse = _reuse(placement, request, prompt_tokens)
        if placement.profile == p.name or p.name in session.same_server:
            prefill_tokens = prompt_tokens - max(reuse, held_here)
        elif _can_hand_off(placement, p, policy, profiles, reuse) and _handoffs_pay(session, p.name, policy):
            # Priced by the prefix the new prompt shares with the saved slot, and only when restoring that prefix is
            # cheaper than prefilling it (a rewritten history may reuse little of a large slot).
            cost = speeds.handoff_s(placement.cached_tokens)
            if reuse > held_here and cost < speeds.prefill_s(p.name, reuse - held_here):
                prefill_tokens = prompt_tokens - reuse
                handoff_s = cost
    out = placement.output_tokens if placement is not None else float(policy.estimator.output_tokens)
    if request.copy_hint and request.hint_output_tokens:
        out = max(out, float(request.hint_output_tokens))
    out_tokens = max(1, int(min(out, request.max_tokens) if request.max_tokens else out))
    context = prompt_tokens + out_tokens / 2
    s_per_token = speeds.decode_s_per_token(p.name, copy_share, context, acceptance)
    prefill_s = speeds.prefill_s(p.name, prefill_tokens)
    return Estimate(
        profile=p.name,
        prefill_tokens=prefill_tokens,
        prefill_s=prefill_s,
        handoff_s=handoff_s,
        output_tokens=out_tokens,
        decode_tps=1.0 / s_per_token,
        speedup=speeds.plain_s_per_token(context) / s_per_token,
        total_s=prefill_s + handoff_s + out_tokens * s_per_token,
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


def _overloaded(p: ProfileState, policy: Policy) -> bool:
    return p.in_flight >= p.slots + policy.route.max_queue


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


@dataclass(frozen=True, slots=True)
class _Deciding:
    """What every rule of one decision sees: the request, its session, the profiles, the speeds and the policy."""

    request: RequestState
    session: SessionState
    by_name: Mapping[str, ProfileState]
    speeds: SpeedModel
    policy: Policy
    copy_share: float
    copy_src: str
    acceptance: float
    acceptance_src: str
    prompt_tokens: int
    held: Mapping[str, str]  # speculating profiles held back by the load rule, and why

    def estimate(self, p: ProfileState) -> Estimate:
        return _estimate(
            p,
            self.request,
            self.session,
            self.copy_share,
            self.acceptance,
            self.prompt_tokens,
            self.speeds,
            self.policy,
            self.by_name,
        )

    def drafter_text(self, profiles: Sequence[str]) -> str:
        """ ", drafts accepted 31% (2-turn avg)" when a model-drafter profile is among `profiles`, else ""."""
        if not any(self.speeds.has_drafter(n) for n in profiles):
            return ""
        return f", drafter accepts {self.acceptance:.0%} ({self.acceptance_src})"

    def decision(self, name: str, kind: str, reason: str, estimates: tuple[Estimate, ...] = ()) -> Decision:
        placement = self.session.placement
        moved = placement.profile if placement is not None and placement.profile != name else None
        handoff = moved is not None and self.estimate(self.by_name[name]).handoff_s > 0
        if moved is not None and name in self.session.same_server and "same server" not in reason:
            reason += f"; same server as {moved}: keeps its KV cache, no handoff"
        measured = self.session.handoff_reuse.get(name)
        low = measured is not None and measured[0] < self.policy.handoff.min_reuse
        if moved is not None and not handoff and low and measured is not None and "what they restored" not in reason:
            reason += (
                f"; re-prefills: handoffs from {moved} reused {measured[0]:.0%} of what they restored, "
                f"{measured[1]} measured"
            )
        return Decision(
            profile=name,
            kind=kind,
            reason=reason,
            copy_share=self.copy_share,
            context_tokens=self.prompt_tokens,
            acceptance=self.acceptance,
            moved_from=moved,
            handoff=handoff,
            handoff_tokens=placement.cached_tokens if handoff and placement else 0,
            estimates=estimates,
        )

    def passed_over(self, name: str, load: bool = True) -> str | None:
        p = self.by_name.get(name)
        if p is None:
            return None
        if p.down_reason is not None:
            return f"{name} is down ({p.down_reason})"
        if _overloaded(p, self.policy):
            return f"{name} is overloaded ({p.in_flight} in flight for {p.slots} slot(s))"
        return self.held.get(name) if load else None


def decide(
    request: RequestState,
    session: SessionState,
    profiles: Sequence[ProfileState],
    speeds: SpeedModel,
    policy: Policy,
) -> Decision:
    """The profile for this request, and why. The rules apply in order, and reading them top to bottom is reading
    the policy: a pin; healthy and not overloaded; a forced profile; the only one allowed (`_by_policy`); a plain
    first turn, the estimates, where the KV lives, dwell and hysteresis, exploration (`_by_estimate`)."""
    copy_share, copy_src = copyability(session, request, policy)
    accepts, accepts_src = acceptance(session, request, policy)
    prompt_tokens = (
        request.prompt_tokens if request.prompt_tokens is not None else speeds.prompt_tokens(request.body_bytes)
    )
    by_name = {p.name: p for p in profiles}
    if request.pinned is not None and request.pinned in by_name:
        c = _Deciding(
            request, session, by_name, speeds, policy, copy_share, copy_src, accepts, accepts_src, prompt_tokens, {}
        )
        return c.decision(request.pinned, "pinned", f"{request.pinned}: pinned by {request.pinned_by}")
    allowed = [by_name[n] for n in policy.route.profiles if n in by_name] or list(profiles)
    usable = _usable(allowed, profiles, policy)
    held = _held_by_load(usable, policy)
    c = _Deciding(
        request, session, by_name, speeds, policy, copy_share, copy_src, accepts, accepts_src, prompt_tokens, held
    )
    if not usable:
        first = allowed[0] if allowed else profiles[0]
        return c.decision(first.name, "fallback", f"{first.name}: every profile is down")
    return _by_policy(c, allowed, usable) or _by_load(c, allowed, usable) or _by_estimate(c, allowed, usable)


def _held_by_load(usable: list[ProfileState], policy: Policy) -> dict[str, str]:
    """The speculating profiles the load rule holds back, each with the figure that decided, where a setting of the
    same server that does not speculate is usable instead (a server of its own is never held back: nothing else
    would serve the request there)."""
    route = policy.route
    plain_servers = {p.server for p in usable if p.server and not p.speculates}
    held = {}
    for p in usable:
        if not p.speculates or p.server not in plain_servers:
            continue
        if route.hold_beside_plain and p.plain_beside >= route.hold_beside_plain:
            held[p.name] = (
                f"load: {p.plain_beside} request(s) without speculation decode on its server "
                f"(route.hold_beside_plain = {route.hold_beside_plain})"
            )
        elif route.speculate_max_busy and p.in_flight >= route.speculate_max_busy:
            held[p.name] = (
                f"load: {p.in_flight} requests in flight on its server (route.speculate_max_busy = "
                f"{route.speculate_max_busy})"
            )
    return held


def _by_load(c: _Deciding, allowed: list[ProfileState], usable: list[ProfileState]) -> Decision | None:
    """The estimates among the profiles the load rule leaves, when it holds back the one they would choose; None:
    it holds back nothing that mattered (the estimates decide as usual)."""
    if not c.held:
        return None
    left = [p for p in usable if p.name not in c.held]
    decision = _by_estimate(c, [p for p in allowed if p.name not in c.held], left)
    unheld = _by_estimate(replace(c, held={}), allowed, usable)
    if unheld.profile not in c.held:
        return unheld
    return replace(
        decision, kind="load", reason=f"{decision.reason}; {unheld.profile} held back: {c.held[unheld.profile]}"
    )


def _usable(allowed: list[ProfileState], profiles: Sequence[ProfileState], policy: Policy) -> list[ProfileState]:
    """The allowed profiles that are up and not overloaded; else the least loaded healthy one; else any healthy."""
    healthy = [p for p in allowed if p.down_reason is None]
    usable = [p for p in healthy if not _overloaded(p, policy)]
    if not usable:
        usable = sorted(healthy, key=lambda p: p.in_flight - p.slots)[:1]
    if not usable:  # nothing healthy among the allowed profiles: try any healthy one
        usable = [p for p in profiles if p.down_reason is None][:1]
    return usable


def _by_policy(c: _Deciding, allowed: list[ProfileState], usable: list[ProfileState]) -> Decision | None:
    """A profile the policy forces, or the only one it allows; None: the estimates decide."""
    force = c.policy.route.force
    if force is not None and force in c.by_name:
        why = c.passed_over(force, load=False)  # what the policy forces is not held back by load
        if why is None:
            return c.decision(force, "forced", f"{force}: forced by the policy")
        alt = min((c.estimate(p) for p in usable), key=lambda e: e.total_s).profile
        return c.decision(alt, "fallback", f"{alt}: the policy forces {force}, but {why}")
    if len(allowed) == 1 and usable[0].name == allowed[0].name:
        return c.decision(usable[0].name, "only", f"{usable[0].name}: the only profile the policy allows")
    return None


def _by_estimate(c: _Deciding, allowed: list[ProfileState], usable: list[ProfileState]) -> Decision:
    """The estimated fastest profile, unless the session stays where its KV lives (dwell, hysteresis)."""
    placement, copy_share, copy_src = c.session.placement, c.copy_share, c.copy_src
    if placement is None and copy_share <= 0.0:
        # A first turn with nothing to copy goes to a profile without n-gram drafting (its pool starts empty and
        # the estimate could only tell noise apart), when the policy allows one.
        plain = [p for p in allowed if not c.speeds.is_ngram(p.name)]
        if plain:
            allowed = plain
            usable = [p for p in usable if not c.speeds.is_ngram(p.name)] or usable
    everywhere = {p.name: c.estimate(p) for p in allowed}
    estimates = tuple(everywhere[p.name] for p in usable if p.name in everywhere) or tuple(
        c.estimate(p) for p in usable
    )  # order = the policy's order: ties go to the first
    best = min(estimates, key=lambda e: e.total_s)
    here = next((e for e in estimates if e.profile == placement.profile), None) if placement is not None else None

    if placement is not None and here is None:  # its KV lives on a profile that is down or overloaded
        why = c.passed_over(placement.profile) or f"{placement.profile} is not allowed by the policy"
        return c.decision(
            best.profile,
            "fallback",
            f"{best.profile}: {why}; {_move_text(best, c.session, c.policy.handoff.min_reuse)}",
            estimates,
        )
    ideal = min(everywhere.values(), key=lambda e: e.total_s) if everywhere else best
    if placement is None and ideal.profile != best.profile:  # the estimated best is down or overloaded
        why = f"{c.passed_over(ideal.profile)}, the estimate's choice"
        reason = f"{best.profile}: {why}; copyable {copy_share:.0%} ({copy_src})"
        return c.decision(best.profile, "fallback", reason, estimates)
    if here is not None and placement is not None and best.profile != here.profile:
        stays = _stays(c, placement, here, best)
        if stays is not None:
            return c.decision(here.profile, "stay", stays, estimates)

    chosen, kind = best, "estimate"
    if placement is None and c.request.explore_draw < c.policy.route.explore and len(estimates) > 1:
        chosen, kind = sorted(estimates, key=lambda e: e.total_s)[1], "explore"
    drafter = c.drafter_text([e.profile for e in estimates])
    reason = _reason(chosen, estimates, copy_share, copy_src, c.session, kind, drafter, c.policy.handoff.min_reuse)
    return c.decision(chosen.profile, kind, reason, estimates)


def _stays(c: _Deciding, placement: Placement, here: Estimate, best: Estimate) -> str | None:
    """Why the session stays where its KV lives though `best` is estimated faster, or None: it moves."""
    gain = 1.0 - best.total_s / here.total_s if here.total_s > 0 else 0.0
    route, copyable = c.policy.route, f"copyable {c.copy_share:.0%} ({c.copy_src})"
    # The dwell spares a session paying for moves back and forth; a move on its own server costs nothing.
    free = best.profile in c.session.same_server
    if placement.turns_here < route.min_dwell_turns and placement.cached_tokens > 0 and not free:
        return (
            f"{here.profile}: stays (turn {placement.turns_here} of a {route.min_dwell_turns}-turn dwell); "
            f"{best.profile} est {gain:.0%} faster; {copyable}"
        )
    if gain < route.hysteresis:
        return (
            f"{here.profile}: stays; {best.profile} est only {gain:.0%} faster (hysteresis "
            f"{route.hysteresis:.0%}); {copyable}"
        )
    return None


def _move_text(chosen: Estimate, session: SessionState, min_reuse: float = 0.0) -> str:
    placement, in_flight_on = session.placement, session.in_flight_on
    if placement is None and in_flight_on is not None:  # not new: its first request has not finished yet
        return (
            f"its earlier request is still in flight on {in_flight_on}; prefills "
            f"{_fmt_tokens(chosen.prefill_tokens)} tok ≈ {chosen.prefill_s:.2f} s"
        )
    if placement is None:
        return f"new session, prefills {_fmt_tokens(chosen.prefill_tokens)} tok ≈ {chosen.prefill_s:.2f} s"
    if placement.profile == chosen.profile:
        return f"stays on its KV cache ({_fmt_tokens(chosen.prefill_tokens)} new tok ≈ {chosen.prefill_s:.2f} s)"
    if chosen.profile in session.same_server:
        return (
            f"same server as {placement.profile}: keeps its KV cache, no handoff "
            f"({_fmt_tokens(chosen.prefill_tokens)} new tok ≈ {chosen.prefill_s:.2f} s)"
        )
    if chosen.handoff_s > 0:
        return (
            f"hands its KV over from {placement.profile} ({_fmt_tokens(placement.cached_tokens)} tok ≈ "
            f"{chosen.handoff_s:.2f} s)"
        )
    text = f"switch re-prefills {_fmt_tokens(chosen.prefill_tokens)} tok ≈ {chosen.prefill_s:.2f} s"
    measured = session.handoff_reuse.get(chosen.profile)
    if measured is not None and measured[0] < min_reuse:
        share, count = measured
        text += (
            f" (handoffs from {placement.profile} reused {share:.0%} of what they restored, {count} measured: "
            "none made)"
        )
    return text


def _reason(
    chosen: Estimate,
    estimates: tuple[Estimate, ...],
    copy_share: float,
    copy_src: str,
    session: SessionState,
    kind: str,
    drafter: str = "",
    min_reuse: float = 0.0,
) -> str:
    placement = session.placement
    others = [e for e in estimates if e.profile != chosen.profile]
    vs = ", ".join(f"{e.profile} {e.speedup:.1f}× ({e.total_s:.1f} s)" for e in others)
    head = (
        f"{chosen.profile}: copyable {copy_share:.0%} ({copy_src}){drafter} → est {chosen.speedup:.1f}× "
        f"({chosen.total_s:.1f} s)"
    )
    if vs:
        head += f" vs {vs}"
    tail = _move_text(chosen, session, min_reuse)
    if placement is not None and placement.profile != chosen.profile and others:
        stay = next((e for e in others if e.profile == placement.profile), None)
        if stay is not None:
            tail += f", pays back this turn (saves {stay.total_s - chosen.total_s:.1f} s)"
    if kind == "explore":
        tail += "; exploring: not the estimated best, to measure it"
    return f"{head}; {tail}"
