"""The profile stage of a routing decision: which profile will finish this request soonest, moves counted.

`decide` is pure: it sees the request, the session (its copyability and where its KV cache lives), the profiles'
health and load, the learned speeds and the policy in force, and returns a `Choice` (routing/decision.py) with one
human line of reason. Each profile's cost is estimated in `routing/estimate.py`; this module owns the rules that
weigh the estimates.

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
from dataclasses import dataclass, replace

from adaptive_spec.policy.model import Policy
from adaptive_spec.routing.decision import Choice, DecisionKind
from adaptive_spec.routing.estimate import (
    Estimate,
    ProfileState,
    RequestState,
    SessionState,
    acceptance,
    copyability,
    estimate_on,
    move_text,
    reason_text,
)
from adaptive_spec.routing.placements import Placement
from adaptive_spec.routing.speeds import SpeedModel


def _overloaded(p: ProfileState, policy: Policy) -> bool:
    return p.in_flight >= p.slots + policy.route.max_queue


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
        return estimate_on(
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

    def choice(
        self,
        name: str,
        kind: DecisionKind,
        reason: str,
        estimates: tuple[Estimate, ...] = (),
        *,
        move_said: bool = False,
    ) -> Choice:
        """The choice of `name`. `move_said`: the reason already says what the session's KV costs there
        (`move_text`); else what a move keeps or loses is added here."""
        placement = self.session.placement
        moved = placement.profile if placement is not None and placement.profile != name else None
        handoff = moved is not None and self.estimate(self.by_name[name]).handoff_s > 0
        parts = [reason]
        if moved is not None and name in self.session.same_server and not move_said:
            parts.append(f"same server as {moved}: keeps its KV cache, no handoff")
        measured = self.session.handoff_reuse.get(name)
        low = measured is not None and measured[0] < self.policy.handoff.min_reuse
        if moved is not None and not handoff and low and measured is not None and not move_said:
            parts.append(
                f"re-prefills: handoffs from {moved} reused {measured[0]:.0%} of what they restored, "
                f"{measured[1]} measured"
            )
        return Choice(
            profile=name,
            kind=kind,
            reasons=tuple(parts),
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
) -> Choice:
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
        return c.choice(request.pinned, "pinned", f"{request.pinned}: pinned by {request.pinned_by}")
    allowed = [by_name[n] for n in policy.route.profiles if n in by_name] or list(profiles)
    usable = _usable(allowed, profiles, policy)
    held = _held_by_load(usable, policy)
    c = _Deciding(
        request, session, by_name, speeds, policy, copy_share, copy_src, accepts, accepts_src, prompt_tokens, held
    )
    if not usable:
        first = allowed[0] if allowed else profiles[0]
        return c.choice(first.name, "fallback", f"{first.name}: every profile is down")
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


def _by_load(c: _Deciding, allowed: list[ProfileState], usable: list[ProfileState]) -> Choice | None:
    """The estimates among the profiles the load rule leaves, when it holds back the one they would choose; None:
    it holds back nothing that mattered (the estimates decide as usual)."""
    if not c.held:
        return None
    left = [p for p in usable if p.name not in c.held]
    chosen = _by_estimate(c, [p for p in allowed if p.name not in c.held], left)
    unheld = _by_estimate(replace(c, held={}), allowed, usable)
    if unheld.profile not in c.held:
        return unheld
    held_back = f"{unheld.profile} held back: {c.held[unheld.profile]}"
    return replace(chosen, kind="load", reasons=(*chosen.reasons, held_back))


def _usable(allowed: list[ProfileState], profiles: Sequence[ProfileState], policy: Policy) -> list[ProfileState]:
    """The allowed profiles that are up and not overloaded; else the least loaded healthy one; else any healthy."""
    healthy = [p for p in allowed if p.down_reason is None]
    usable = [p for p in healthy if not _overloaded(p, policy)]
    if not usable:
        usable = sorted(healthy, key=lambda p: p.in_flight - p.slots)[:1]
    if not usable:  # nothing healthy among the allowed profiles: try any healthy one
        usable = [p for p in profiles if p.down_reason is None][:1]
    return usable


def _by_policy(c: _Deciding, allowed: list[ProfileState], usable: list[ProfileState]) -> Choice | None:
    """A profile the policy forces, or the only one it allows; None: the estimates decide."""
    force = c.policy.route.force
    if force is not None and force in c.by_name:
        why = c.passed_over(force, load=False)  # what the policy forces is not held back by load
        if why is None:
            return c.choice(force, "forced", f"{force}: forced by the policy")
        alt = min((c.estimate(p) for p in usable), key=lambda e: e.total_s).profile
        return c.choice(alt, "fallback", f"{alt}: the policy forces {force}, but {why}")
    if len(allowed) == 1 and usable[0].name == allowed[0].name:
        return c.choice(usable[0].name, "only", f"{usable[0].name}: the only profile the policy allows")
    return None


def _by_estimate(c: _Deciding, allowed: list[ProfileState], usable: list[ProfileState]) -> Choice:
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
        return c.choice(
            best.profile,
            "fallback",
            f"{best.profile}: {why}; {move_text(best, c.session, c.policy.handoff.min_reuse)}",
            estimates,
            move_said=True,
        )
    ideal = min(everywhere.values(), key=lambda e: e.total_s) if everywhere else best
    if placement is None and ideal.profile != best.profile:  # the estimated best is down or overloaded
        why = f"{c.passed_over(ideal.profile)}, the estimate's choice"
        reason = f"{best.profile}: {why}; copyable {copy_share:.0%} ({copy_src})"
        return c.choice(best.profile, "fallback", reason, estimates)
    if here is not None and placement is not None and best.profile != here.profile:
        stays = _stays(c, placement, here, best)
        if stays is not None:
            return c.choice(here.profile, "stay", stays, estimates)

    chosen: Estimate = best
    kind: DecisionKind = "estimate"
    if placement is None and c.request.explore_draw < c.policy.route.explore and len(estimates) > 1:
        chosen, kind = sorted(estimates, key=lambda e: e.total_s)[1], "explore"
    drafter = c.drafter_text([e.profile for e in estimates])
    reason = reason_text(chosen, estimates, copy_share, copy_src, c.session, kind, drafter, c.policy.handoff.min_reuse)
    return c.choice(chosen.profile, kind, reason, estimates, move_said=True)


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
